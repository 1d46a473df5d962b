//! Checkpoints: Hugging Face folders (config.json + safetensors, single or sharded, dense or
//! MLX-quantized) and GGUF files, turned into one name → tensor map with Hugging Face names.
//!
//! GGUF tensors are renamed to the Hugging Face layout (`blk.3.attn_q` →
//! `model.layers.3.self_attn.q_proj`) and the llama config is rebuilt from the `llama.*`
//! metadata, so every family file reads one naming scheme. llama.cpp permutes the rows of
//! llama's Q and K projections for its interleaved RoPE; they are permuted back here so the
//! model uses the same (non-interleaved) RoPE and the same KV layout as the Hugging Face
//! checkpoint.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use mlx::io::GgufValue;
use mlx::{Array, Dtype, QuantSpec, Quantized};
use serde_json::{json, Map, Value};

use crate::error::{EngineError, Result};
use crate::layers::{Embedding, Linear, RmsNorm};

/// How weights are held after loading.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Keep weights as stored (quantized, bf16, f16) instead of expanding them to f32.
    /// On CPU, MLX's f32 matmul (OpenBLAS) is far faster than its quantized and bf16 kernels
    /// (figures: docs/engine.md).
    /// Default: false.
    pub keep_as_stored: bool,
}

/// Quantization of an MLX checkpoint: a default spec and per-module overrides.
#[derive(Clone, Debug, Default)]
struct QuantConfig {
    default: Option<QuantSpec>,
    overrides: HashMap<String, Option<QuantSpec>>,
    /// GGUF blocks are groups of 32 whatever the bits.
    gguf: bool,
}

/// Everything read from a model path: config, tensors, and GGUF metadata when it is one.
pub(crate) struct Checkpoint {
    /// The Hugging Face config (rebuilt from metadata for GGUF).
    pub(crate) config: Value,
    /// Where `config` came from, for messages.
    pub(crate) source: String,
    /// The folder (for tokenizer files), `None` for GGUF.
    pub(crate) folder: Option<PathBuf>,
    /// The files whose bytes are the weights, in a stable order.
    pub(crate) files: Vec<PathBuf>,
    /// GGUF metadata (tokenizer, chat template), empty for a folder.
    pub(crate) gguf_metadata: BTreeMap<String, GgufValue>,
    /// The tensors.
    pub(crate) weights: Weights,
}

/// Tensors by (Hugging Face) name, and how to turn them into layers.
pub(crate) struct Weights {
    tensors: HashMap<String, Array>,
    quant: QuantConfig,
    options: LoadOptions,
}

/// Largest JSON file of a model folder read (config.json, tokenizer_config.json, the
/// safetensors index, generation_config.json): real ones are kilobytes.
pub(crate) const MAX_JSON_BYTES: u64 = 16 << 20;
/// Largest tokenizer.json read (Gemma 3's is 33 MB).
pub(crate) const MAX_TOKENIZER_BYTES: u64 = 512 << 20;
/// Largest chat_template.jinja read.
pub(crate) const MAX_TEMPLATE_BYTES: u64 = 4 << 20;

/// Reads a small file of a model folder: it must be a regular file (a link to `/dev/zero`
/// or a FIFO is refused before it is opened) of at most `cap` bytes.
pub(crate) fn read_capped(path: &Path, cap: u64) -> Result<Vec<u8>> {
    use std::io::{Error, ErrorKind, Read};
    let refuse = |kind, message: String| EngineError::io(path, Error::new(kind, message));
    let not_regular = || {
        refuse(
            ErrorKind::InvalidInput,
            "not a regular file (a directory, FIFO or device); model files must be regular \
             files"
                .into(),
        )
    };
    let too_long = |len: u64| {
        refuse(
            ErrorKind::InvalidData,
            format!("{len} bytes, more than the {cap} a file of this kind may have"),
        )
    };
    let meta = std::fs::metadata(path).map_err(|e| EngineError::io(path, e))?;
    if !meta.is_file() {
        return Err(not_regular());
    }
    if meta.len() > cap {
        return Err(too_long(meta.len()));
    }
    let f = std::fs::File::open(path).map_err(|e| EngineError::io(path, e))?;
    if !f
        .metadata()
        .map_err(|e| EngineError::io(path, e))?
        .is_file()
    {
        return Err(not_regular());
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    f.take(cap + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| EngineError::io(path, e))?;
    if bytes.len() as u64 > cap {
        return Err(too_long(bytes.len() as u64));
    }
    Ok(bytes)
}

pub(crate) fn read_json(path: &Path) -> Result<Value> {
    let bytes = read_capped(path, MAX_JSON_BYTES)?;
    serde_json::from_slice(&bytes)
        .map_err(|e| EngineError::config(path.display().to_string(), e.to_string()))
}

/// Largest value accepted for each dimension of a config, with its GGUF key (after
/// `<arch>.`). Real models are far inside (Llama 3.1 405B: 126 layers, hidden 16,384,
/// vocabulary 128,256); a value outside comes from a corrupt or hostile file and would size
/// allocations that abort the process.
const CONFIG_BOUNDS: &[(&str, &str, u64)] = &[
    ("num_hidden_layers", "block_count", 1024),
    ("hidden_size", "embedding_length", 1 << 16),
    ("intermediate_size", "feed_forward_length", 1 << 20),
    ("num_attention_heads", "attention.head_count", 1024),
    ("num_key_value_heads", "attention.head_count_kv", 1024),
    ("head_dim", "attention.key_length", 4096),
    ("vocab_size", "tokenizer.ggml.tokens", 1 << 22),
    ("max_position_embeddings", "context_length", 1 << 24),
    ("sliding_window", "attention.sliding_window", 1 << 24),
];

/// Refuses a config whose dimensions no real model has (see [`CONFIG_BOUNDS`]), naming the
/// field (and its GGUF key when the config came from GGUF metadata).
pub(crate) fn check_config_bounds(
    config: &Value,
    source: &str,
    gguf_arch: Option<&str>,
) -> Result<()> {
    let nested = config.get("text_config");
    for obj in std::iter::once(config).chain(nested) {
        for &(field, key, max) in CONFIG_BOUNDS {
            let Some(v) = obj.get(field).filter(|v| !v.is_null()) else {
                continue;
            };
            if v.as_u64().is_some_and(|n| (1..=max).contains(&n)) {
                continue;
            }
            let from = match gguf_arch {
                Some(_) if key.starts_with("tokenizer.") => format!(" (GGUF {key})"),
                Some(arch) => format!(" (GGUF key {arch}.{key})"),
                None => String::new(),
            };
            return Err(EngineError::config(
                source,
                format!(
                    "{field}{from} is {v}, outside 1..={max}: no real model has that; the file \
                     is corrupt or made to crash loaders"
                ),
            ));
        }
    }
    Ok(())
}

impl Checkpoint {
    /// Loads a `.gguf` file or a Hugging Face folder.
    pub(crate) fn load(path: &Path, options: &LoadOptions) -> Result<Checkpoint> {
        if !path.exists() {
            Err(EngineError::io(
                path,
                std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or folder"),
            ))
        } else if path.is_dir() {
            Self::load_folder(path, options)
        } else if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        {
            Self::load_gguf(path, options)
        } else {
            Err(EngineError::NotAModel(path.to_path_buf()))
        }
    }

    fn load_folder(dir: &Path, options: &LoadOptions) -> Result<Checkpoint> {
        let config_path = dir.join("config.json");
        if !config_path.exists() {
            return Err(EngineError::NotAModel(dir.to_path_buf()));
        }
        let config = read_json(&config_path)?;
        check_config_bounds(&config, &config_path.display().to_string(), None)?;
        let index = dir.join("model.safetensors.index.json");
        let mut files: Vec<PathBuf> = if index.is_file() {
            let idx = read_json(&index)?;
            let map = idx
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| {
                    EngineError::config(index.display().to_string(), "no weight_map object")
                })?;
            let mut names: Vec<&str> = map.values().filter_map(Value::as_str).collect();
            names.sort_unstable();
            names.dedup();
            // Shards are files of this folder: no path may lead out of it.
            if let Some(n) = names.iter().find(|n| {
                let p = Path::new(n);
                p.components().count() != 1
                    || !matches!(p.components().next(), Some(std::path::Component::Normal(_)))
            }) {
                return Err(EngineError::config(
                    index.display().to_string(),
                    format!("weight_map names {n:?}, which is not a file name in this folder"),
                ));
            }
            names.into_iter().map(|n| dir.join(n)).collect()
        } else {
            let rd = std::fs::read_dir(dir).map_err(|e| EngineError::io(dir, e))?;
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
                .collect()
        };
        files.sort();
        if files.is_empty() {
            return Err(EngineError::NotAModel(dir.to_path_buf()));
        }
        let mut tensors = HashMap::new();
        for f in &files {
            let st = mlx::io::load_safetensors(f).map_err(|e| corrupt(f, e))?;
            tensors.extend(st.tensors);
        }
        let quant = quant_config(&config, &config_path.display().to_string())?;
        Ok(Checkpoint {
            config,
            source: config_path.display().to_string(),
            folder: Some(dir.to_path_buf()),
            files,
            gguf_metadata: BTreeMap::new(),
            weights: Weights {
                tensors,
                quant,
                options: options.clone(),
            },
        })
    }

    fn load_gguf(path: &Path, options: &LoadOptions) -> Result<Checkpoint> {
        let gguf = mlx::io::load_gguf(path).map_err(|e| match corrupt(path, e) {
            // MLX dequantizes only Q4_0 / Q4_1 / Q8_0; say what to do with K-quant files.
            EngineError::CorruptWeights { path, message } if message.contains("gguf_tensor_to_f16") => {
                EngineError::CorruptWeights {
                    path,
                    message: format!(
                        "{message} (MLX reads Q4_0/Q4_1/Q8_0 GGUFs; K-quant files such as Gemma 3's \
                         Q4_K_M need converting first: bash scripts/setup.sh --with-gemma)"
                    ),
                }
            }
            other => other,
        })?;
        let source = format!("GGUF metadata of {}", path.display());
        let config = gguf_config(&gguf.metadata, &gguf.tensors, &source)?;
        let arch = config["model_type"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        check_config_bounds(&config, &source, Some(&arch))?;
        let heads = config["num_attention_heads"].as_i64().unwrap_or(1) as i32;
        let kv_heads = config["num_key_value_heads"].as_i64().unwrap_or(1) as i32;
        // Which families' conversion permuted Q/K is the registry's (gguf_config already
        // refused a family without a GGUF layout).
        let permuted = crate::models::family(&arch)
            .and_then(|f| f.gguf)
            .is_some_and(|g| g.permuted_qk);
        let mut tensors = HashMap::new();
        for (name, t) in gguf.tensors {
            let hf = gguf_to_hf_name(&name);
            let t = if permuted && hf.contains(".self_attn.q_proj.") {
                unpermute_rows(&t, heads)?
            } else if permuted && hf.contains(".self_attn.k_proj.") {
                unpermute_rows(&t, kv_heads)?
            } else {
                t
            };
            tensors.insert(hf, t);
        }
        Ok(Checkpoint {
            config,
            source,
            folder: None,
            files: vec![path.to_path_buf()],
            gguf_metadata: gguf.metadata,
            weights: Weights {
                tensors,
                quant: QuantConfig {
                    gguf: true,
                    ..QuantConfig::default()
                },
                options: options.clone(),
            },
        })
    }
}

fn corrupt(path: &Path, e: mlx::Error) -> EngineError {
    match e {
        mlx::Error::Mlx { message, .. } => EngineError::CorruptWeights {
            path: path.to_path_buf(),
            message,
        },
        // Refused by the checks that run before MLX parses the file.
        mlx::Error::InvalidFile { reason, .. } => EngineError::CorruptWeights {
            path: path.to_path_buf(),
            message: reason,
        },
        mlx::Error::Io { path, source } => EngineError::Io { path, source },
        other => EngineError::Mlx(other),
    }
}

fn quant_config(config: &Value, source: &str) -> Result<QuantConfig> {
    let Some(q) = config
        .get("quantization")
        .or_else(|| config.get("quantization_config"))
    else {
        return Ok(QuantConfig::default());
    };
    let spec = |v: &Value| -> Result<QuantSpec> {
        if let Some(mode) = v.get("mode").and_then(Value::as_str) {
            if mode != "affine" {
                return Err(EngineError::config(
                    source,
                    format!("quantization mode {mode:?} is not supported (affine only)"),
                ));
            }
        }
        let g = v.get("group_size").and_then(Value::as_i64).unwrap_or(64) as i32;
        let b = v.get("bits").and_then(Value::as_i64).unwrap_or(4) as i32;
        QuantSpec::new(g, b).map_err(|e| EngineError::config(source, e.to_string()))
    };
    let mut out = QuantConfig {
        default: Some(spec(q)?),
        ..QuantConfig::default()
    };
    if let Some(obj) = q.as_object() {
        for (k, v) in obj {
            match v {
                Value::Object(_) => {
                    out.overrides.insert(k.clone(), Some(spec(v)?));
                }
                Value::Bool(false) => {
                    out.overrides.insert(k.clone(), None);
                }
                _ => {}
            }
        }
    }
    Ok(out)
}

/// `blk.N.attn_q.weight` → `model.layers.N.self_attn.q_proj.weight` and friends.
fn gguf_to_hf_name(name: &str) -> String {
    let (stem, suffix) = match name.rsplit_once('.') {
        Some((s, x)) if ["weight", "bias", "scales", "biases"].contains(&x) => (s, x),
        _ => (name, ""),
    };
    let mapped = match stem {
        "token_embd" => "model.embed_tokens".to_string(),
        "output_norm" => "model.norm".to_string(),
        "output" => "lm_head".to_string(),
        s => match s.strip_prefix("blk.").and_then(|r| r.split_once('.')) {
            Some((n, part)) => {
                let hf = match part {
                    "attn_norm" => "input_layernorm",
                    "ffn_norm" => "post_attention_layernorm",
                    "attn_q" => "self_attn.q_proj",
                    "attn_k" => "self_attn.k_proj",
                    "attn_v" => "self_attn.v_proj",
                    "attn_output" => "self_attn.o_proj",
                    "attn_q_norm" => "self_attn.q_norm",
                    "attn_k_norm" => "self_attn.k_norm",
                    "ffn_gate" => "mlp.gate_proj",
                    "ffn_up" => "mlp.up_proj",
                    "ffn_down" => "mlp.down_proj",
                    other => return format!("gguf.blk.{n}.{other}.{suffix}"),
                };
                format!("model.layers.{n}.{hf}")
            }
            None => format!("gguf.{s}"),
        },
    };
    if suffix.is_empty() {
        mapped
    } else {
        format!("{mapped}.{suffix}")
    }
}

/// Undoes llama.cpp's `permute(w, n_head)`: rows `(h, d/2, 2)` → `(h, 2, d/2)`.
fn unpermute_rows(t: &Array, heads: i32) -> Result<Array> {
    let shape = t.shape();
    let rows = shape.first().copied().unwrap_or(0);
    if heads <= 0 || rows % (heads * 2) != 0 {
        return Err(EngineError::ShapeMismatch {
            name: "GGUF attn_q/attn_k rows".into(),
            expected: vec![heads * 2, -1],
            actual: shape,
        });
    }
    let rest: Vec<i32> = shape[1..].to_vec();
    let mut s = vec![heads, rows / heads / 2, 2];
    s.extend(&rest);
    let mut axes: Vec<i32> = vec![0, 2, 1];
    axes.extend((3..s.len() as i32).collect::<Vec<_>>());
    Ok(t.reshape(&s)?
        .transpose(&axes)?
        .reshape(&shape)?
        .contiguous()?)
}

/// Expands a quantized matrix with f32 scales and biases, so no rounding to the stored
/// half type happens on the way to f32.
fn dequantize_f32(q: &Quantized) -> Result<Array> {
    let q = Quantized {
        packed: q.packed.clone(),
        scales: q.scales.astype(Dtype::F32)?,
        biases: q.biases.astype(Dtype::F32)?,
        spec: q.spec,
    };
    Ok(mlx::dequantize(&q)?)
}

fn meta_f64(meta: &BTreeMap<String, GgufValue>, key: &str) -> Option<f64> {
    match meta.get(key) {
        Some(GgufValue::Array(a)) if a.size() == 1 => a.item_f32().ok().map(f64::from),
        _ => None,
    }
}

/// A Hugging Face config.json equivalent of a GGUF file's `<arch>.*` metadata.
fn gguf_config(
    meta: &BTreeMap<String, GgufValue>,
    tensors: &BTreeMap<String, Array>,
    source: &str,
) -> Result<Value> {
    let arch = match meta.get("general.architecture") {
        Some(GgufValue::String(s)) => s.clone(),
        _ => return Err(EngineError::config(source, "no general.architecture")),
    };
    if crate::models::family(&arch).and_then(|f| f.gguf).is_none() {
        return Err(EngineError::UnsupportedArchitecture(arch));
    }
    let get = |k: &str| meta_f64(meta, &format!("{arch}.{k}"));
    let need =
        |k: &str| get(k).ok_or_else(|| EngineError::config(source, format!("missing {arch}.{k}")));
    let hidden = need("embedding_length")?;
    let heads = need("attention.head_count")?;
    let vocab = match meta.get("tokenizer.ggml.tokens") {
        Some(GgufValue::Strings(t)) => t.len() as f64,
        _ => need("vocab_size")?,
    };
    let head_dim = get("attention.key_length")
        .or_else(|| get("rope.dimension_count"))
        .unwrap_or(hidden / heads);
    let mut c = Map::new();
    c.insert("model_type".into(), json!(arch));
    c.insert("hidden_size".into(), json!(hidden as u64));
    c.insert(
        "intermediate_size".into(),
        json!(need("feed_forward_length")? as u64),
    );
    c.insert(
        "num_hidden_layers".into(),
        json!(need("block_count")? as u64),
    );
    c.insert("num_attention_heads".into(), json!(heads as u64));
    c.insert(
        "num_key_value_heads".into(),
        json!(get("attention.head_count_kv").unwrap_or(heads) as u64),
    );
    c.insert("head_dim".into(), json!(head_dim as u64));
    c.insert(
        "rms_norm_eps".into(),
        json!(need("attention.layer_norm_rms_epsilon")?),
    );
    c.insert(
        "rope_theta".into(),
        json!(get("rope.freq_base").unwrap_or(10000.0)),
    );
    c.insert(
        "max_position_embeddings".into(),
        json!(get("context_length").unwrap_or(2048.0) as u64),
    );
    c.insert("vocab_size".into(), json!(vocab as u64));
    c.insert(
        "tie_word_embeddings".into(),
        json!(!tensors.contains_key("output.weight")),
    );
    if let Some(f) = get("rope.scaling.factor") {
        if let Some(GgufValue::String(t)) = meta.get(&format!("{arch}.rope.scaling.type")) {
            if t == "linear" {
                c.insert(
                    "rope_scaling".into(),
                    json!({"rope_type": "linear", "factor": f}),
                );
            }
        }
    }
    Ok(Value::Object(c))
}

impl Weights {
    fn get(&self, name: &str) -> Result<&Array> {
        self.tensors
            .get(name)
            .ok_or_else(|| EngineError::MissingTensor(name.to_string()))
    }

    fn expect_shape(name: &str, t: &Array, expected: &[i32]) -> Result<()> {
        if t.shape() != expected {
            return Err(EngineError::ShapeMismatch {
                name: name.to_string(),
                expected: expected.to_vec(),
                actual: t.shape(),
            });
        }
        Ok(())
    }

    /// The quantized form of `{prefix}.weight` `[rows, cols]`, if it is quantized.
    fn quantized(&self, prefix: &str, rows: i32, cols: i32) -> Result<Option<Quantized>> {
        let (Some(scales), Some(biases)) = (
            self.tensors.get(&format!("{prefix}.scales")),
            self.tensors.get(&format!("{prefix}.biases")),
        ) else {
            return Ok(None);
        };
        let wname = format!("{prefix}.weight");
        let packed = self.get(&wname)?;
        let group = if self.quant.gguf {
            32
        } else {
            match self.quant.overrides.get(prefix) {
                Some(Some(s)) => s.group_size,
                _ => self.quant.default.map(|s| s.group_size).unwrap_or(64),
            }
        };
        let pshape = packed.shape();
        if cols % group != 0 || pshape.len() != 2 {
            return Err(EngineError::ShapeMismatch {
                name: wname,
                expected: vec![rows, -1],
                actual: pshape,
            });
        }
        // bits follow from the packed width: cols · bits / 32 words per row.
        let bits = pshape[1] * 32 / cols;
        let spec = QuantSpec::new(group, bits).map_err(|_| EngineError::ShapeMismatch {
            name: wname.clone(),
            expected: vec![rows, cols * 4 / 32],
            actual: pshape.clone(),
        })?;
        Self::expect_shape(&wname, packed, &[rows, cols * bits / 32])?;
        Self::expect_shape(&format!("{prefix}.scales"), scales, &[rows, cols / group])?;
        Self::expect_shape(&format!("{prefix}.biases"), biases, &[rows, cols / group])?;
        Ok(Some(Quantized {
            packed: packed.clone(),
            scales: scales.clone(),
            biases: biases.clone(),
            spec,
        }))
    }

    /// A dense tensor in the compute dtype (f32 unless weights are kept as stored).
    fn dense(&self, name: &str, shape: &[i32]) -> Result<Array> {
        let t = self.get(name)?;
        Self::expect_shape(name, t, shape)?;
        self.finish(t.clone())
    }

    fn finish(&self, t: Array) -> Result<Array> {
        let t = if self.options.keep_as_stored || t.dtype() == Dtype::F32 {
            t
        } else {
            t.astype(Dtype::F32)?
        };
        t.eval()?;
        Ok(t)
    }

    /// The linear layer `{prefix}` mapping `cols` → `rows`, with a bias when `bias`.
    pub(crate) fn linear(
        &self,
        prefix: &str,
        rows: usize,
        cols: usize,
        bias: bool,
    ) -> Result<Linear> {
        let (rows, cols) = (rows as i32, cols as i32);
        let b = if bias {
            Some(self.dense(&format!("{prefix}.bias"), &[rows])?)
        } else {
            None
        };
        match self.quantized(prefix, rows, cols)? {
            Some(q) if self.options.keep_as_stored => Ok(Linear::quantized(q, b)),
            Some(q) => Ok(Linear::dense(self.finish(dequantize_f32(&q)?)?, b)),
            None => Ok(Linear::dense(
                self.dense(&format!("{prefix}.weight"), &[rows, cols])?,
                b,
            )),
        }
    }

    /// The embedding table `{prefix}` of `vocab` × `hidden`.
    pub(crate) fn embedding(&self, prefix: &str, vocab: usize, hidden: usize) -> Result<Embedding> {
        let (v, h) = (vocab as i32, hidden as i32);
        match self.quantized(prefix, v, h)? {
            Some(q) if self.options.keep_as_stored => Ok(Embedding::Quantized(q)),
            Some(q) => Ok(Embedding::Dense(self.finish(dequantize_f32(&q)?)?)),
            None => Ok(Embedding::Dense(
                self.dense(&format!("{prefix}.weight"), &[v, h])?,
            )),
        }
    }

    /// The vector `name` of `dim` entries (a bias).
    pub(crate) fn vector(&self, name: &str, dim: usize) -> Result<Array> {
        self.dense(name, &[dim as i32])
    }

    /// The taps of the depthwise 1-D convolution `{prefix}` over `channels` channels with
    /// `kernel` taps, as `[kernel, channels]`. Read from MLX's layout `[channels, kernel,
    /// 1]` or Hugging Face's `[channels, 1, kernel]`.
    pub(crate) fn depthwise_conv(
        &self,
        prefix: &str,
        channels: usize,
        kernel: usize,
    ) -> Result<Array> {
        let name = format!("{prefix}.weight");
        let t = self.get(&name)?;
        let (c, k) = (channels as i32, kernel as i32);
        let taps = if t.shape() == [c, k, 1] {
            t.reshape(&[c, k])?
        } else {
            Self::expect_shape(&name, t, &[c, 1, k])?;
            t.reshape(&[c, k])?
        };
        self.finish(taps.transpose(&[1, 0])?.contiguous()?)
    }

    /// The RMS norm `{prefix}` over `dim` features.
    pub(crate) fn rms_norm(&self, prefix: &str, dim: usize, eps: f64) -> Result<RmsNorm> {
        Ok(RmsNorm {
            weight: self.dense(&format!("{prefix}.weight"), &[dim as i32])?,
            eps: eps as f32,
        })
    }
}
