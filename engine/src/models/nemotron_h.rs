//! Nemotron-H: a hybrid of Mamba-2 layers, attention layers and MLP-only layers, in the
//! order `hybrid_override_pattern` spells (`M`: Mamba-2, `*`: attention, `-`: MLP).
//!
//! Every block is `x + mixer(norm(x))`. Attention has no positional encoding (no RoPE) and no
//! q/k norms. The MLP is `down(relu(up(x))²)`. A Mamba-2 mixer projects to a gate `z`, the
//! convolution input `[x | B | C]` and per-head time steps `dt`; the input runs through a
//! causal depthwise convolution of `conv_kernel` taps and SiLU; then per token, with
//! `Δ = clip(softplus(dt + dt_bias))` and `A = −exp(A_log)`: `S ← exp(Δ·A)·S + (Δ·x) ⊗ B`,
//! `y = S·C + D·x` (B and C shared by the heads of a group); `y · silu(z)` is RMS-normed
//! and projected out (mlx-lm's `nemotron_h`; its CPU path computes the same recurrence in
//! chunks, `ssm_attn`).
//!
//! A Mamba-2 layer's state is two arrays: the convolution's last `K − 1` inputs `[B, K−1,
//! conv_dim]` and the SSM state `[B, heads, head_dim, state_size]`, carried in the cache's
//! state layers.

use cache::{KvCache, PagedKvRows};
use mlx::fast::{self, AttentionMask};
use mlx::Array;
use serde::Deserialize;

use crate::error::{EngineError, Result};
use crate::layers::{
    softplus, step, Attention, CausalConv, Embedding, FusedLinear, Linear, RmsNorm,
};
use crate::model::{KvLayout, LayerKind, ModelInfo};
use crate::models::{
    check_cache_states, check_rows_states, mix_cache, mix_rows, Built, Family, Network, StateMixer,
};
use crate::weights::{Checkpoint, Weights};

/// `hybrid_override_pattern`: a string (`"M*M-"`, as Hugging Face configs write it) or a
/// list of one-character strings.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Pattern {
    /// `"M*M-"`.
    Text(String),
    /// `["M", "*", "M", "-"]`.
    List(Vec<String>),
}

impl Pattern {
    fn blocks(&self) -> Vec<String> {
        match self {
            Pattern::Text(s) => s.chars().map(String::from).collect(),
            Pattern::List(l) => l.clone(),
        }
    }
}

fn no_limit() -> (f64, f64) {
    (0.0, f64::MAX)
}

/// A Nemotron-H `config.json` (the fields the model reads).
#[derive(Clone, Debug, Deserialize)]
pub struct Config {
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP layers.
    pub intermediate_size: usize,
    /// Layers (must match the pattern's length).
    pub num_hidden_layers: usize,
    /// Query heads of the attention layers.
    pub num_attention_heads: usize,
    /// Key/value heads of the attention layers.
    pub num_key_value_heads: usize,
    /// Per-head width of the attention layers; defaults to hidden / heads.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// Biases on q/k/v/o.
    #[serde(default)]
    pub attention_bias: bool,
    /// Mamba-2 heads.
    pub mamba_num_heads: usize,
    /// Mamba-2 head width.
    pub mamba_head_dim: usize,
    /// Biases on the Mamba-2 projections.
    #[serde(default)]
    pub mamba_proj_bias: bool,
    /// SSM state width per group.
    pub ssm_state_size: usize,
    /// Taps of the Mamba-2 convolution.
    pub conv_kernel: usize,
    /// Groups sharing B and C.
    pub n_groups: usize,
    /// Bounds of the time step Δ (defaults to no bound).
    #[serde(default = "no_limit")]
    pub time_step_limit: (f64, f64),
    /// Biases on the MLP projections.
    #[serde(default)]
    pub mlp_bias: bool,
    /// Epsilon of the Mamba-2 output norm.
    pub layer_norm_epsilon: f64,
    /// Epsilon of the block norms.
    pub rms_norm_eps: f64,
    /// A bias on the convolution taps.
    #[serde(default)]
    pub use_conv_bias: bool,
    /// The layer pattern.
    pub hybrid_override_pattern: Pattern,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Context the model was trained for.
    pub max_position_embeddings: usize,
}

impl Config {
    fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    fn inner(&self) -> usize {
        self.mamba_num_heads * self.mamba_head_dim
    }

    fn conv_dim(&self) -> usize {
        self.inner() + 2 * self.n_groups * self.ssm_state_size
    }

    fn validate(&self, source: &str) -> Result<Vec<String>> {
        let bad = |m: String| Err(EngineError::config(source, m));
        let blocks = self.hybrid_override_pattern.blocks();
        if blocks.len() != self.num_hidden_layers {
            return bad(format!(
                "hybrid_override_pattern has {} layers, num_hidden_layers {}",
                blocks.len(),
                self.num_hidden_layers
            ));
        }
        if let Some(b) = blocks
            .iter()
            .find(|b| !["M", "*", "-"].contains(&b.as_str()))
        {
            return bad(format!(
                "layer kind {b:?} in hybrid_override_pattern (M, *, - are supported)"
            ));
        }
        if !blocks.iter().any(|b| b == "*") {
            return bad("no attention layer: the engine needs at least one".into());
        }
        let positive = [
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim(),
            self.mamba_num_heads,
            self.mamba_head_dim,
            self.ssm_state_size,
            self.n_groups,
        ];
        if positive.contains(&0)
            || !self
                .num_attention_heads
                .is_multiple_of(self.num_key_value_heads)
            || !self.mamba_num_heads.is_multiple_of(self.n_groups)
        {
            return bad(
                "heads, widths and groups must be positive, heads a multiple of KV heads and of \
                 groups"
                    .into(),
            );
        }
        if !(2..=64).contains(&self.conv_kernel) {
            return bad(format!(
                "conv_kernel {} is outside 2..=64",
                self.conv_kernel
            ));
        }
        let (lo, hi) = self.time_step_limit;
        if !(lo >= 0.0 && lo <= hi) {
            return bad(format!("time_step_limit ({lo}, {hi}) is not a range"));
        }
        Ok(blocks)
    }
}

/// A Mamba-2 mixer (mlx-lm's `NemotronHMamba2Mixer`).
#[derive(Debug)]
struct Mamba2 {
    in_proj: Linear,
    conv1d: CausalConv,
    a_log: Array,
    d: Array,
    dt_bias: Array,
    norm: RmsNorm,
    out_proj: Linear,
    heads: i32,
    head_dim: i32,
    groups: i32,
    state_size: i32,
    dt_limit: (f64, f64),
}

impl StateMixer for Mamba2 {
    /// `x` `[B, L, hidden]` after `state` (convolution inputs, SSM state; zeros before the
    /// first token) → output `[B, L, hidden]` and the state after `x`.
    fn mix(&self, x: &Array, state: Option<&[Array]>) -> Result<(Array, Vec<Array>)> {
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let (h, dh, g, ds) = (self.heads, self.head_dim, self.groups, self.state_size);
        let inner = h * dh;
        let conv_dim = inner + 2 * g * ds;
        // 1. (B, L, hidden) -> gate z | convolution input | dt.
        let p = self.in_proj.forward(x)?;
        let z = p.slice(&[0, 0, 0], &[b, l, inner])?;
        let input = p.slice(&[0, 0, inner], &[b, l, inner + conv_dim])?;
        let dt = p.slice(&[0, 0, inner + conv_dim], &[b, l, inner + conv_dim + h])?;
        // 2. Causal depthwise convolution after the kept inputs, SiLU.
        let (conv, next_conv) = self.conv1d.forward(&input, state.map(|st| &st[0]))?;
        let conv = conv.silu()?;
        let xs = conv
            .slice(&[0, 0, 0], &[b, l, inner])?
            .reshape(&[b, l, h, dh])?;
        let per = h / g;
        // B and C per group, repeated to its heads: (B, L, G, Ds) -> (B, L, H, Ds).
        let group = |from: i32| -> Result<Array> {
            let a = conv
                .slice(&[0, 0, from], &[b, l, from + g * ds])?
                .reshape(&[b, l, g, 1, ds])?
                .broadcast_to(&[b, l, g, per, ds])?
                .reshape(&[b, l, h, ds])?;
            Ok(a)
        };
        let (bm, cm) = (group(inner)?, group(inner + g * ds)?);
        // 3. Δ = clip(softplus(dt + dt_bias)), decay exp(Δ·A) with A = −exp(A_log).
        let sp = softplus(&dt.add(&self.dt_bias)?)?;
        let (lo, hi) = self.dt_limit;
        let lo_a = Array::scalar(lo, sp.dtype())?;
        let hi_a = Array::scalar(hi.min(f32::MAX as f64), sp.dtype())?;
        let delta = sp.maximum(&lo_a)?.minimum(&hi_a)?;
        let decay = delta.mul(&self.a_log.exp()?.neg()?)?.exp()?;
        // 4. The recurrence, token by token: S [B, H, Dh, Ds].
        let mut s = match state {
            Some(st) => st[1].clone(),
            None => mlx::ops::zeros(&[b, h, dh, ds], xs.dtype())?,
        };
        let d = self.d.reshape(&[1, h, 1])?;
        let mut ys = Vec::with_capacity(l as usize);
        for t in 0..l {
            let (xt, bt, ct) = (step(&xs, t)?, step(&bm, t)?, step(&cm, t)?);
            let (dtt, dat) = (step(&delta, t)?, step(&decay, t)?);
            let dx = xt.mul(&dtt.expand_dims(2)?)?;
            s = s
                .mul(&dat.expand_dims(2)?.expand_dims(3)?)?
                .add(&dx.expand_dims(3)?.mul(&bt.expand_dims(2)?)?)?;
            let y = s.mul(&ct.expand_dims(2)?)?.sum(-1, false)?;
            ys.push(y.add(&xt.mul(&d)?)?);
        }
        let refs: Vec<&Array> = ys.iter().collect();
        let y = mlx::ops::stack(&refs, 1)?.reshape(&[b, l, inner])?;
        // 5. Gate, norm, project out.
        let y = self.norm.forward(&y.mul(&z.silu()?)?)?;
        Ok((self.out_proj.forward(&y)?, vec![next_conv, s]))
    }
}

#[derive(Debug)]
enum Mixer {
    Mamba(Mamba2, usize),
    Attention(Attention, usize),
    Mlp { up: Linear, down: Linear },
}

#[derive(Debug)]
struct Block {
    norm: RmsNorm,
    mixer: Mixer,
}

/// A Nemotron-H network.
#[derive(Debug)]
pub(crate) struct NemotronH {
    embeddings: Embedding,
    layers: Vec<Block>,
    norm_f: RmsNorm,
    lm_head: Linear,
    mamba_layers: usize,
    state_shapes: Vec<Vec<usize>>,
}

/// Attention without positional encoding over the cache: `[1, L, hidden]`.
fn attend(a: &Attention, x: &Array, layer: usize, cache: &mut dyn KvCache) -> Result<Array> {
    let (q, k, v) = a.heads(x)?;
    let (keys, values) = cache.update_and_fetch(layer, &k, &v)?;
    let mask = if x.shape()[1] > 1 {
        AttentionMask::Causal
    } else {
        AttentionMask::None
    };
    let o = fast::scaled_dot_product_attention(&q, &keys, &values, a.scale, mask)?;
    a.output(&o)
}

impl NemotronH {
    fn new(cfg: &Config, w: &Weights, source: &str) -> Result<Self> {
        let blocks = cfg.validate(source)?;
        let (h, hd) = (cfg.hidden_size, cfg.head_dim());
        let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let bias = cfg.mamba_proj_bias;
        let (mut attn, mut mamba) = (0, 0);
        let mut layers = Vec::with_capacity(blocks.len());
        for (i, kind) in blocks.iter().enumerate() {
            let p = format!("backbone.layers.{i}");
            let m = format!("{p}.mixer");
            let mixer = match kind.as_str() {
                "M" => {
                    let inner = cfg.inner();
                    let proj = inner + cfg.conv_dim() + cfg.mamba_num_heads;
                    let heads = cfg.mamba_num_heads;
                    let mixer = Mixer::Mamba(
                        Mamba2 {
                            in_proj: w.linear(&format!("{m}.in_proj"), proj, h, bias)?,
                            conv1d: CausalConv::load(
                                w,
                                &format!("{m}.conv1d"),
                                cfg.conv_dim(),
                                cfg.conv_kernel,
                                cfg.use_conv_bias,
                            )?,
                            a_log: w.vector(&format!("{m}.A_log"), heads)?,
                            d: w.vector(&format!("{m}.D"), heads)?,
                            dt_bias: w.vector(&format!("{m}.dt_bias"), heads)?,
                            norm: w.rms_norm(
                                &format!("{m}.norm"),
                                inner,
                                cfg.layer_norm_epsilon,
                            )?,
                            out_proj: w.linear(&format!("{m}.out_proj"), h, inner, bias)?,
                            heads: heads as i32,
                            head_dim: cfg.mamba_head_dim as i32,
                            groups: cfg.n_groups as i32,
                            state_size: cfg.ssm_state_size as i32,
                            dt_limit: cfg.time_step_limit,
                        },
                        mamba,
                    );
                    mamba += 1;
                    mixer
                }
                "*" => {
                    let b = cfg.attention_bias;
                    let mixer = Mixer::Attention(
                        Attention {
                            qkv: FusedLinear::new(vec![
                                w.linear(&format!("{m}.q_proj"), nh * hd, h, b)?,
                                w.linear(&format!("{m}.k_proj"), nkv * hd, h, b)?,
                                w.linear(&format!("{m}.v_proj"), nkv * hd, h, b)?,
                            ])?,
                            o_proj: w.linear(&format!("{m}.o_proj"), h, nh * hd, b)?,
                            q_norm: None,
                            k_norm: None,
                            num_heads: nh as i32,
                            num_kv_heads: nkv as i32,
                            head_dim: hd as i32,
                            scale: (hd as f32).powf(-0.5),
                        },
                        attn,
                    );
                    attn += 1;
                    mixer
                }
                _ => {
                    let (ff, b) = (cfg.intermediate_size, cfg.mlp_bias);
                    Mixer::Mlp {
                        up: w.linear(&format!("{m}.up_proj"), ff, h, b)?,
                        down: w.linear(&format!("{m}.down_proj"), h, ff, b)?,
                    }
                }
            };
            layers.push(Block {
                norm: w.rms_norm(&format!("{p}.norm"), h, cfg.rms_norm_eps)?,
                mixer,
            });
        }
        Ok(NemotronH {
            embeddings: w.embedding("backbone.embeddings", cfg.vocab_size, h)?,
            layers,
            norm_f: w.rms_norm("backbone.norm_f", h, cfg.rms_norm_eps)?,
            lm_head: w.linear("lm_head", cfg.vocab_size, h, false)?,
            mamba_layers: mamba,
            state_shapes: vec![
                vec![1, cfg.conv_kernel - 1, cfg.conv_dim()],
                vec![
                    1,
                    cfg.mamba_num_heads,
                    cfg.mamba_head_dim,
                    cfg.ssm_state_size,
                ],
            ],
        })
    }

    /// `down(relu(up(x))²)`.
    fn mlp(up: &Linear, down: &Linear, x: &Array) -> Result<Array> {
        let u = up.forward(x)?;
        let zero = mlx::ops::zeros(&[], u.dtype())?;
        down.forward(&u.maximum(&zero)?.square()?)
    }
}

impl Network for NemotronH {
    fn hidden(&self, tokens: &Array, cache: &mut dyn KvCache) -> Result<Array> {
        check_cache_states("Nemotron-H", self.mamba_layers, cache)?;
        let mut h = self.embeddings.forward(tokens)?;
        for block in &self.layers {
            let x = block.norm.forward(&h)?;
            let r = match &block.mixer {
                Mixer::Attention(a, kv) => attend(a, &x, *kv, cache)?,
                Mixer::Mamba(m, slot) => mix_cache(m, &x, *slot, cache)?,
                Mixer::Mlp { up, down } => Self::mlp(up, down, &x)?,
            };
            h = h.add(&r)?;
        }
        self.norm_f.forward(&h)
    }

    fn hidden_rows(&self, tokens: &Array, rows: &mut PagedKvRows) -> Result<Array> {
        check_rows_states("Nemotron-H", self.mamba_layers, rows)?;
        let mut h = self.embeddings.forward(tokens)?;
        for block in &self.layers {
            let x = block.norm.forward(&h)?;
            let r = match &block.mixer {
                Mixer::Attention(a, kv) => {
                    let (q, k, v) = a.heads(&x)?;
                    let o = rows.attend(*kv, &q, &k, &v, a.scale, None)?;
                    a.output(&o)?
                }
                Mixer::Mamba(m, slot) => mix_rows(m, &x, *slot, rows)?,
                Mixer::Mlp { up, down } => Self::mlp(up, down, &x)?,
            };
            h = h.add(&r)?;
        }
        self.norm_f.forward(&h)
    }

    fn logits(&self, h: &Array) -> Result<Array> {
        self.lm_head.forward(h)
    }

    fn state_shapes(&self) -> Vec<Vec<Vec<usize>>> {
        vec![self.state_shapes.clone(); self.mamba_layers]
    }

    fn layer_kinds(&self) -> Vec<LayerKind> {
        self.layers
            .iter()
            .map(|b| match b.mixer {
                Mixer::Attention(..) => LayerKind::Global,
                Mixer::Mamba(..) => LayerKind::Recurrent,
                Mixer::Mlp { .. } => LayerKind::Mlp,
            })
            .collect()
    }
}

fn build(ck: &Checkpoint) -> Result<Built> {
    let cfg: Config = serde_json::from_value(ck.config.clone())
        .map_err(|e| EngineError::config(&ck.source, e.to_string()))?;
    let net = NemotronH::new(&cfg, &ck.weights, &ck.source)?;
    let attention = net
        .layers
        .iter()
        .filter(|b| matches!(b.mixer, Mixer::Attention(..)))
        .count();
    let info = ModelInfo {
        architecture: FAMILY.model_type.to_string(),
        vocab_size: cfg.vocab_size,
        hidden_size: cfg.hidden_size,
        num_heads: cfg.num_attention_heads,
        max_position_embeddings: cfg.max_position_embeddings,
        rope_theta: 0.0,
        kv: KvLayout {
            layers: attention,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim(),
            dtype: net.embeddings.dtype(),
            state_layers: net.mamba_layers,
        },
    };
    Ok((Box::new(net), info))
}

/// Nemotron-H, from Hugging Face folders.
pub(crate) const FAMILY: Family = Family {
    model_type: "nemotron_h",
    gguf: None,
    build,
};
