//! Namespace descriptions and their reproducible ids.

use serde::{Deserialize, Serialize};

use crate::block::{Dtype, PlaneSpec};
use crate::format;
use crate::key::NamespaceId;

/// Affine KV quantization parameters (as in MLX's `quantize`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvQuantization {
    /// Bits per element (4 or 8).
    pub bits: u32,
    /// Elements sharing one scale and bias.
    pub group_size: u32,
}

/// Everything that changes the bytes of a block. Two processes that describe the same model
/// the same way get the same [`NamespaceId`], on any machine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamespaceDescription {
    /// Human-readable model name (e.g. `SmolLM2-135M-Instruct`).
    pub model: String,
    /// Fingerprint of the weights, hex (e.g. blake3 of the weight files).
    pub weights_fingerprint: String,
    /// Hash of the model configuration, hex.
    pub config_hash: String,
    /// Hash of the tokenizer (vocabulary, merges, special tokens), hex.
    pub tokenizer_hash: String,
    /// Element type of the stored K/V planes before quantization.
    pub kv_dtype: Dtype,
    /// KV quantization, if the planes hold quantized values.
    pub kv_quantization: Option<KvQuantization>,
    /// Tokens per block.
    pub block_size: u32,
    /// One entry per layer: `"global"` or `"window(N)"` for sliding-window attention.
    pub layers: Vec<String>,
    /// RoPE settings in a canonical text form (e.g. `"theta=10000,scaling=none"`).
    pub rope: String,
    /// Store format version the blocks are written in; normally [`format::FORMAT_VERSION`].
    pub format_version: u32,
    /// Optional salt separating tenants or adapters that share a model.
    pub salt: Option<String>,
    /// The exact plane layout of every block in this namespace, in order.
    pub planes: Vec<PlaneSpec>,
    /// The planes a *snapshot block* of a hybrid model carries after [`Self::planes`]: the
    /// state of every non-attention layer at the block's end (format version 2). Empty for
    /// attention-only models, whose blocks all have exactly [`Self::planes`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub state_planes: Vec<PlaneSpec>,
    /// The planes of a *window-trimmed block* of a model with sliding-window layers:
    /// [`Self::planes`] less every window layer's, in the same order. A block that no
    /// continuation can still attend to through its window layers is stored this way
    /// (docs/cache.md, "Window layers"). Empty for models without window layers, whose
    /// blocks all carry every plane.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub trimmed_planes: Vec<PlaneSpec>,
}

impl NamespaceDescription {
    /// A description with the given model name, KV dtype and block size; every other field
    /// empty, no quantization, no salt, and the current format version.
    pub fn new(model: impl Into<String>, kv_dtype: Dtype, block_size: u32) -> Self {
        NamespaceDescription {
            model: model.into(),
            weights_fingerprint: String::new(),
            config_hash: String::new(),
            tokenizer_hash: String::new(),
            kv_dtype,
            kv_quantization: None,
            block_size,
            layers: Vec::new(),
            rope: String::new(),
            format_version: format::FORMAT_VERSION,
            salt: None,
            planes: Vec::new(),
            state_planes: Vec::new(),
            trimmed_planes: Vec::new(),
        }
    }

    /// Checks a block's plane layout: [`Self::planes`] or, for a window-trimmed block,
    /// [`Self::trimmed_planes`]; for a snapshot block of a hybrid model either of them
    /// followed by [`Self::state_planes`].
    pub(crate) fn check_planes(&self, found: &[PlaneSpec]) -> Result<(), crate::LayoutError> {
        let full = self.check_layout(&self.planes, found);
        if full.is_err() && self.is_trimmed(found) {
            return Ok(());
        }
        full
    }

    /// Whether `found` is the layout of a window-trimmed block of this namespace
    /// ([`Self::trimmed_planes`], then the state planes for a snapshot block).
    pub fn is_trimmed(&self, found: &[PlaneSpec]) -> bool {
        !self.trimmed_planes.is_empty()
            && self.check_layout(&self.trimmed_planes, found).is_ok()
            && self.check_layout(&self.planes, found).is_err()
    }

    /// Checks `found` against the K/V layout `kv`, alone or followed by the state planes.
    fn check_layout(
        &self,
        kv: &[PlaneSpec],
        found: &[PlaneSpec],
    ) -> Result<(), crate::LayoutError> {
        let check = |kv: &[PlaneSpec]| {
            if !self.state_planes.is_empty() && found.len() == kv.len() + self.state_planes.len() {
                let expected: Vec<PlaneSpec> =
                    kv.iter().chain(&self.state_planes).cloned().collect();
                return crate::block::check_specs(&expected, found);
            }
            crate::block::check_specs(kv, found)
        };
        check(kv)
    }

    /// Bytes a window-trimmed block leaves out: those of [`Self::planes`] less those of
    /// [`Self::trimmed_planes`] (0 without window layers).
    pub fn trimmed_bytes_per_block(&self) -> u64 {
        if self.trimmed_planes.is_empty() {
            return 0;
        }
        let bytes =
            |specs: &[PlaneSpec]| -> u64 { specs.iter().filter_map(|p| p.byte_len()).sum() };
        bytes(&self.planes).saturating_sub(bytes(&self.trimmed_planes))
    }

    /// The canonical byte encoding hashed into the id (see docs/store-format.md): every
    /// string and list length-prefixed with a little-endian `u64`, integers little-endian,
    /// options as a `u8` tag, fields in declaration order after a domain tag and version.
    pub fn canonical_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(256);
        put_bytes(&mut out, format::NAMESPACE_DOMAIN);
        out.extend_from_slice(&format::NAMESPACE_ENCODING_VERSION.to_le_bytes());
        put_str(&mut out, &self.model);
        put_str(&mut out, &self.weights_fingerprint);
        put_str(&mut out, &self.config_hash);
        put_str(&mut out, &self.tokenizer_hash);
        put_str(&mut out, self.kv_dtype.name());
        match self.kv_quantization {
            None => out.push(0),
            Some(q) => {
                out.push(1);
                out.extend_from_slice(&q.bits.to_le_bytes());
                out.extend_from_slice(&q.group_size.to_le_bytes());
            }
        }
        out.extend_from_slice(&self.block_size.to_le_bytes());
        out.extend_from_slice(&(self.layers.len() as u64).to_le_bytes());
        for layer in &self.layers {
            put_str(&mut out, layer);
        }
        put_str(&mut out, &self.rope);
        out.extend_from_slice(&self.format_version.to_le_bytes());
        match &self.salt {
            None => out.push(0),
            Some(s) => {
                out.push(1);
                put_str(&mut out, s);
            }
        }
        put_specs(&mut out, &self.planes);
        // Appended only when present, so attention-only namespaces keep their encoding.
        // Field 16 (trimmed planes) comes after field 15, which is then written even when
        // empty: the fields still parse back in one way only.
        if !self.state_planes.is_empty() || !self.trimmed_planes.is_empty() {
            put_specs(&mut out, &self.state_planes);
        }
        if !self.trimmed_planes.is_empty() {
            put_specs(&mut out, &self.trimmed_planes);
        }
        out
    }

    /// `blake3(canonical_bytes())`.
    pub fn id(&self) -> NamespaceId {
        NamespaceId(*blake3::hash(&self.canonical_bytes()).as_bytes())
    }
}

fn put_specs(out: &mut Vec<u8>, specs: &[PlaneSpec]) {
    out.extend_from_slice(&(specs.len() as u64).to_le_bytes());
    for p in specs {
        put_str(out, &p.name);
        put_str(out, p.dtype.name());
        out.extend_from_slice(&(p.shape.len() as u64).to_le_bytes());
        for d in &p.shape {
            out.extend_from_slice(&d.to_le_bytes());
        }
    }
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    out.extend_from_slice(b);
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    put_bytes(out, s.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_blocks_fit_only_a_namespace_with_their_state_planes() {
        let kv = PlaneSpec::new("layers.0.k", Dtype::F32, vec![2, 16, 8]);
        let state = PlaneSpec::new("states.0.0", Dtype::F32, vec![2, 64]);
        let mut d = NamespaceDescription::new("m", Dtype::F32, 16);
        d.planes = vec![kv.clone()];
        let plain = d.id();
        assert!(d.check_planes(std::slice::from_ref(&kv)).is_ok());
        assert!(d.check_planes(&[kv.clone(), state.clone()]).is_err());
        d.state_planes = vec![state.clone()];
        assert_ne!(d.id(), plain);
        assert!(d.check_planes(std::slice::from_ref(&kv)).is_ok());
        assert!(d.check_planes(&[kv.clone(), state.clone()]).is_ok());
        let other = PlaneSpec::new("states.0.0", Dtype::F32, vec![3, 64]);
        assert!(d.check_planes(&[kv.clone(), other]).is_err());
        assert!(d.check_planes(&[state.clone(), kv.clone()]).is_err());
        // A window-trimmed block: the planes less the window layers', with or without state.
        let window = PlaneSpec::new("layers.1.k", Dtype::F32, vec![2, 16, 8]);
        d.planes = vec![kv.clone(), window.clone()];
        assert!(d.check_planes(std::slice::from_ref(&kv)).is_err());
        d.trimmed_planes = vec![kv.clone()];
        assert!(d.check_planes(std::slice::from_ref(&kv)).is_ok());
        assert!(d.check_planes(&[kv.clone(), state.clone()]).is_ok());
        assert!(d
            .check_planes(&[kv.clone(), window.clone(), state.clone()])
            .is_ok());
        assert!(d.check_planes(std::slice::from_ref(&window)).is_err());
        assert!(d.check_planes(&[]).is_err());
        assert_eq!(d.trimmed_bytes_per_block(), 2 * 16 * 8 * 4);
        // An attention-only description encodes (and is named) as before state planes.
        let json = serde_json::to_string(&NamespaceDescription::new("m", Dtype::F32, 16)).unwrap();
        assert!(!json.contains("state_planes"));
    }

    #[test]
    fn every_field_changes_the_id() {
        let base = NamespaceDescription::new("m", Dtype::BF16, 16);
        let id = base.id();
        type Change = Box<dyn Fn(&mut NamespaceDescription)>;
        let variants: Vec<Change> = vec![
            Box::new(|d| d.model.push('x')),
            Box::new(|d| d.weights_fingerprint.push('x')),
            Box::new(|d| d.config_hash.push('x')),
            Box::new(|d| d.tokenizer_hash.push('x')),
            Box::new(|d| d.kv_dtype = Dtype::F16),
            Box::new(|d| {
                d.kv_quantization = Some(KvQuantization {
                    bits: 4,
                    group_size: 64,
                })
            }),
            Box::new(|d| d.block_size = 32),
            Box::new(|d| d.layers.push("global".into())),
            Box::new(|d| d.rope.push('x')),
            Box::new(|d| d.format_version += 1),
            Box::new(|d| d.salt = Some(String::new())),
            Box::new(|d| d.planes.push(PlaneSpec::new("k", Dtype::F32, vec![1]))),
            Box::new(|d| {
                d.state_planes
                    .push(PlaneSpec::new("states.0.0", Dtype::F32, vec![2, 8]))
            }),
            Box::new(|d| {
                d.trimmed_planes
                    .push(PlaneSpec::new("layers.0.k", Dtype::F32, vec![2, 8]))
            }),
        ];
        // State planes and trimmed planes of the same layout are told apart.
        let spec = PlaneSpec::new("p", Dtype::F32, vec![2, 8]);
        let (mut s, mut t) = (base.clone(), base.clone());
        s.state_planes = vec![spec.clone()];
        t.trimmed_planes = vec![spec];
        assert_ne!(s.id(), t.id());
        for (i, change) in variants.iter().enumerate() {
            let mut d = base.clone();
            change(&mut d);
            assert_ne!(d.id(), id, "field change {i} did not change the id");
        }
        // Length prefixes keep field boundaries apart.
        let mut a = base.clone();
        a.model = "ab".into();
        a.weights_fingerprint = "c".into();
        let mut b = base.clone();
        b.model = "a".into();
        b.weights_fingerprint = "bc".into();
        assert_ne!(a.id(), b.id());
    }
}
