//! [`PublishedBlock`]: an immutable block of tokens across all layers, held as MLX arrays
//! in the store's RAM tier and converted to and from the store's host-byte planes.
//!
//! Planes of a block, per layer `i` in order: `layers.{i}.k`, then (quantized formats)
//! `layers.{i}.k_scales`, `layers.{i}.k_biases`, then the same for `v`. Each plane is
//! `[kv_heads, block_size, width]`: width is head_dim for float formats, head_dim·bits/32
//! (uint32) for packed values and head_dim/group_size for scales and biases.

use std::sync::Mutex;

use mlx::Array;
use store::{Block, BlockMeta, Payload, Plane, PlaneSpec};

use crate::pool::BlockShape;
use crate::{CacheError, KvFormat, PagedConfig};

/// An immutable published block: its metadata and its own copies of every layer's K/V.
///
/// The arrays are evaluated when the block is made and never written again; the mutex
/// only makes the type `Sync` for the store (MLX handles are not), and is held just for
/// the duration of a read.
#[derive(Debug)]
pub struct PublishedBlock {
    meta: BlockMeta,
    /// Per layer: K parts then V parts, each `[H, bs, width]`.
    layers: Mutex<Vec<Vec<Array>>>,
    specs: Vec<PlaneSpec>,
    bytes: u64,
}

fn to_store_dtype(d: mlx::Dtype) -> Result<store::Dtype, CacheError> {
    Ok(match d {
        mlx::Dtype::F32 => store::Dtype::F32,
        mlx::Dtype::F16 => store::Dtype::F16,
        mlx::Dtype::BF16 => store::Dtype::BF16,
        mlx::Dtype::U32 => store::Dtype::U32,
        mlx::Dtype::I32 => store::Dtype::I32,
        mlx::Dtype::U8 => store::Dtype::U8,
        other => {
            return Err(CacheError::Shape(format!(
                "the store cannot hold {other} planes"
            )))
        }
    })
}

fn to_mlx_dtype(d: store::Dtype) -> mlx::Dtype {
    match d {
        store::Dtype::F32 => mlx::Dtype::F32,
        store::Dtype::F16 => mlx::Dtype::F16,
        store::Dtype::BF16 => mlx::Dtype::BF16,
        store::Dtype::U32 => mlx::Dtype::U32,
        store::Dtype::I32 => mlx::Dtype::I32,
        store::Dtype::U8 => mlx::Dtype::U8,
    }
}

/// Plane names of one layer for a format, in order.
fn part_names(layer: usize, format: KvFormat) -> Vec<String> {
    ["k", "v"]
        .iter()
        .flat_map(|kv| {
            format
                .part_suffixes()
                .iter()
                .map(move |s| format!("layers.{layer}.{kv}{s}"))
        })
        .collect()
}

/// The plane layout every block of a model has: what a store namespace records so that
/// blocks of another shape are refused.
pub fn plane_specs(
    layers: usize,
    shape: BlockShape,
    format: KvFormat,
) -> Result<Vec<PlaneSpec>, CacheError> {
    format.validate(shape.head_dim)?;
    let probe = mlx::ops::zeros(&[1, shape.head_dim as i32], shape.dtype)?;
    let parts = format.encode(&probe)?;
    let mut out = Vec::new();
    for layer in 0..layers {
        for (name, part) in part_names(layer, format)
            .into_iter()
            .zip(parts.iter().chain(&parts))
        {
            out.push(PlaneSpec::new(
                name,
                to_store_dtype(part.dtype())?,
                vec![
                    shape.kv_heads as u64,
                    shape.block_size as u64,
                    part.shape()[1] as u64,
                ],
            ));
        }
    }
    Ok(out)
}

impl PublishedBlock {
    /// A block from evaluated per-layer parts (`[H, bs, width]`, K parts then V parts).
    pub(crate) fn new(
        meta: BlockMeta,
        format: KvFormat,
        layers: Vec<Vec<Array>>,
    ) -> Result<Self, CacheError> {
        let mut specs = Vec::new();
        let mut bytes = 0u64;
        for (i, parts) in layers.iter().enumerate() {
            for (name, a) in part_names(i, format).into_iter().zip(parts) {
                bytes += a.nbytes() as u64;
                specs.push(PlaneSpec::new(
                    name,
                    to_store_dtype(a.dtype())?,
                    a.shape().iter().map(|&d| d as u64).collect(),
                ));
            }
        }
        Ok(Self {
            meta,
            layers: Mutex::new(layers),
            specs,
            bytes,
        })
    }

    /// The block's identity: namespace, key, parent, position, tokens.
    pub fn meta(&self) -> &BlockMeta {
        &self.meta
    }

    /// Layers in the block.
    pub fn layers(&self) -> usize {
        self.layers.lock().map_or(0, |l| l.len())
    }

    /// One part of one layer (K parts then V parts), `[H, bs, width]`.
    pub fn part(&self, layer: usize, part: usize) -> Result<Array, CacheError> {
        let layers = self.layers.lock().map_err(|_| CacheError::Restore {
            position: self.meta.position as usize,
            reason: "block lock poisoned".into(),
        })?;
        layers
            .get(layer)
            .and_then(|l| l.get(part))
            .cloned()
            .ok_or_else(|| CacheError::Restore {
                position: self.meta.position as usize,
                reason: format!("no part {part} in layer {layer}"),
            })
    }

    /// Checks that this block can sit at `position` of a cache with `layers` layers and
    /// `config`, after `prev`, with the block shape of the blocks before it. Returns the
    /// block shape it implies.
    pub(crate) fn check_restorable(
        &self,
        position: usize,
        layers: usize,
        config: &PagedConfig,
        prev: Option<&BlockMeta>,
        expected: Option<BlockShape>,
    ) -> Result<BlockShape, CacheError> {
        let fail = |reason: String| CacheError::Restore { position, reason };
        if self.meta.position as usize != position {
            return Err(fail(format!(
                "it is block {} of its chain",
                self.meta.position
            )));
        }
        if self.meta.tokens.len() != config.block_size {
            return Err(fail(format!(
                "it holds {} tokens, the cache uses blocks of {}",
                self.meta.tokens.len(),
                config.block_size
            )));
        }
        match prev {
            None if self.meta.parent != *self.meta.namespace.as_bytes() => {
                return Err(fail("the first block's parent is not its namespace".into()))
            }
            Some(p)
                if (self.meta.parent != *p.key.as_bytes()
                    || p.namespace != self.meta.namespace) =>
            {
                return Err(fail("its parent is not the block before it".into()))
            }
            _ => {}
        }
        let guard = self
            .layers
            .lock()
            .map_err(|_| fail("block lock poisoned".into()))?;
        if guard.len() != layers {
            return Err(fail(format!(
                "it has {} layers, the model {layers}",
                guard.len()
            )));
        }
        let per = config.format.parts() * 2;
        let first = guard[0]
            .first()
            .ok_or_else(|| fail("layer 0 is empty".into()))?;
        let s = first.shape();
        if s.len() != 3 || s[1] as usize != config.block_size {
            return Err(fail(format!("layer 0 keys are {s:?}")));
        }
        let width = s[2] as usize;
        let (head_dim, dtype) = match config.format {
            KvFormat::Float => (width, first.dtype()),
            KvFormat::Quantized { bits, .. } => {
                let scales = guard[0]
                    .get(1)
                    .ok_or_else(|| fail("missing key scales".into()))?;
                (width * 32 / bits as usize, scales.dtype())
            }
        };
        let shape = BlockShape {
            kv_heads: s[0] as usize,
            block_size: config.block_size,
            head_dim,
            dtype,
        };
        if let Some(e) = expected {
            if e != shape {
                return Err(fail(format!(
                    "its shape {shape:?} differs from the blocks before it ({e:?})"
                )));
            }
        }
        // Every part of every layer must match the layout the format implies.
        let specs = plane_specs(layers, shape, config.format)?;
        let mut i = 0;
        for (li, parts) in guard.iter().enumerate() {
            if parts.len() != per {
                return Err(fail(format!(
                    "layer {li} has {} parts, {:?} needs {per}",
                    parts.len(),
                    config.format
                )));
            }
            for a in parts {
                let spec = &specs[i];
                let got: Vec<u64> = a.shape().iter().map(|&d| d as u64).collect();
                if got != spec.shape || to_store_dtype(a.dtype())? != spec.dtype {
                    return Err(fail(format!(
                        "plane {} is {:?} {}, expected {:?} {:?}",
                        spec.name,
                        got,
                        a.dtype(),
                        spec.shape,
                        spec.dtype
                    )));
                }
                i += 1;
            }
        }
        Ok(shape)
    }
}

impl Payload for PublishedBlock {
    type Error = CacheError;

    fn meta(&self) -> &BlockMeta {
        &self.meta
    }

    fn byte_size(&self) -> u64 {
        self.bytes
    }

    fn plane_specs(&self) -> Vec<PlaneSpec> {
        self.specs.clone()
    }

    fn to_block(&self) -> Result<Block, CacheError> {
        let layers = self
            .layers
            .lock()
            .map_err(|_| CacheError::Publish("block lock poisoned".into()))?;
        let mut planes = Vec::with_capacity(self.specs.len());
        for (spec, a) in self.specs.iter().zip(layers.iter().flatten()) {
            planes.push(Plane::new(
                spec.name.clone(),
                spec.dtype,
                spec.shape.clone(),
                a.to_bytes()?,
            ));
        }
        Ok(Block {
            meta: self.meta.clone(),
            planes,
        })
    }

    fn from_block(block: Block) -> Result<Self, CacheError> {
        let mut layers: Vec<Vec<Array>> = Vec::new();
        for plane in &block.planes {
            let layer = plane
                .name
                .strip_prefix("layers.")
                .and_then(|r| r.split('.').next())
                .and_then(|n| n.parse::<usize>().ok())
                .ok_or_else(|| {
                    CacheError::Shape(format!(
                        "plane name {:?} is not layers.<i>.<part>",
                        plane.name
                    ))
                })?;
            if layer > layers.len() {
                return Err(CacheError::Shape(format!(
                    "plane {} comes before layer {}",
                    plane.name,
                    layers.len()
                )));
            }
            if layer == layers.len() {
                layers.push(Vec::new());
            }
            let shape: Vec<i32> = plane
                .shape
                .iter()
                .map(|&d| {
                    i32::try_from(d).map_err(|_| {
                        CacheError::Shape(format!("plane {} dimension {d} too large", plane.name))
                    })
                })
                .collect::<Result<_, _>>()?;
            let a = Array::from_bytes(&plane.data, &shape, to_mlx_dtype(plane.dtype))?;
            layers[layer].push(a);
        }
        let specs = block.planes.iter().map(Plane::spec).collect();
        let bytes = block.data_len();
        let all: Vec<&Array> = layers.iter().flatten().collect();
        mlx::eval(&all)?;
        Ok(Self {
            meta: block.meta,
            layers: Mutex::new(layers),
            specs,
            bytes,
        })
    }
}
