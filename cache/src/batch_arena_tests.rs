//! The slot arena against a naive reference: each row's KV kept as plain contiguous arrays
//! on the side, its attention computed alone from them. Rows of very different lengths,
//! joins and leaves in every order, a row longer than the arena's columns, the bytes a
//! join and a leave copy, and the budget.

use mlx::{Array, Dtype};

use crate::{KvCache, PagedConfig, PagedKvCache, PagedKvRows};

const LAYERS: usize = 2;
const HEADS: i32 = 2;
const QUERY_HEADS: i32 = 4;
const DIM: i32 = 8;
const SCALE: f32 = 0.5;
/// Bytes one token of a row takes: layers × K and V × heads × dims × f32.
const PER_TOKEN: u64 = (LAYERS as u64) * 2 * (HEADS as u64) * (DIM as u64) * 4;

fn random(shape: &[i32], seed: u64) -> Array {
    mlx::random::normal(shape, Dtype::F32, &mlx::random::key(seed).unwrap()).unwrap()
}

/// A batch with the arena on (rows pushed without reservations unless `push_reserved`)
/// and, on the side, every row's KV as contiguous `[1, H, len, D]` arrays per layer.
struct Twin {
    rows: PagedKvRows,
    reference: Vec<Vec<(Array, Array)>>,
    seed: u64,
}

impl Twin {
    fn new() -> Self {
        let mut rows = PagedKvRows::new();
        rows.set_batch_arena(true).unwrap();
        Twin {
            rows,
            reference: Vec::new(),
            seed: 1,
        }
    }

    /// A row of `tokens` random tokens, and its reference.
    fn make(&mut self, tokens: i32) -> (PagedKvCache, Vec<(Array, Array)>) {
        let config = PagedConfig {
            block_size: 4,
            initial_blocks: 2,
            ..PagedConfig::default()
        };
        let mut c = PagedKvCache::new(LAYERS, config).unwrap();
        let mut reference = Vec::new();
        for l in 0..LAYERS {
            self.seed += 1;
            let k = random(&[1, HEADS, tokens, DIM], self.seed);
            let v = k.mul_scalar(2.0).unwrap().add_scalar(0.5).unwrap();
            c.append(l, &k, &v).unwrap();
            reference.push((k, v));
        }
        (c, reference)
    }

    fn push(&mut self, tokens: i32) {
        let (c, r) = self.make(tokens);
        self.rows.push(c).unwrap();
        self.reference.push(r);
    }

    fn push_reserved(&mut self, tokens: i32, bytes: u64) {
        let (c, r) = self.make(tokens);
        self.rows.push_reserved(c, bytes).unwrap();
        self.reference.push(r);
    }

    /// One decode step through `attend`, each layer's output checked against each row's
    /// attention computed alone over its reference KV.
    fn step(&mut self) {
        let b = self.rows.len() as i32;
        for l in 0..LAYERS {
            self.seed += 1;
            let q = random(&[b, QUERY_HEADS, 1, DIM], self.seed);
            let k = random(&[b, HEADS, 1, DIM], self.seed + 1000);
            let v = k.mul_scalar(-3.0).unwrap();
            let out = self.rows.attend(l, &q, &k, &v, SCALE, None).unwrap();
            assert_eq!(out.shape(), &[b, QUERY_HEADS, 1, DIM]);
            let got = out.to_vec::<f32>().unwrap();
            let per_row = (QUERY_HEADS * DIM) as usize;
            for (i, r) in self.reference.iter_mut().enumerate() {
                let i32_ = i as i32;
                let pick = |x: &Array, h: i32| x.slice(&[i32_, 0, 0, 0], &[i32_ + 1, h, 1, DIM]);
                let (rk, rv) = &r[l];
                let rk = mlx::ops::concatenate(&[rk, &pick(&k, HEADS).unwrap()], 2).unwrap();
                let rv = mlx::ops::concatenate(&[rv, &pick(&v, HEADS).unwrap()], 2).unwrap();
                let want = alone_attention(&pick(&q, QUERY_HEADS).unwrap(), &rk, &rv);
                let g = &got[i * per_row..(i + 1) * per_row];
                // Plus the f32 products' own rounding, which is TF32's on a CUDA GPU
                // (docs/cuda.md, "Tolerances on the GPU"); nothing on the CPU.
                let u = mlx::f32_matmul_unit_roundoff().unwrap();
                let products = 4.0 * u * want.iter().fold(0f32, |m, x| m.max(x.abs()));
                for (j, (g, w)) in g.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-5 + 1e-4 * w.abs() + products,
                        "layer {l} row {i} element {j}: {g} vs {w}"
                    );
                }
                r[l] = (rk, rv);
            }
        }
    }

    /// Keeps the rows at `keep`; every row that leaves holds exactly its reference KV.
    fn filter(&mut self, keep: &[usize]) {
        let gone = self.rows.filter(keep).unwrap();
        let leaving: Vec<usize> = (0..self.reference.len())
            .filter(|i| !keep.contains(i))
            .collect();
        assert_eq!(gone.len(), leaving.len());
        for (c, &i) in gone.iter().zip(&leaving) {
            assert_holds(c, &self.reference[i]);
        }
        self.reference = keep.iter().map(|&i| self.reference[i].clone()).collect();
    }

    /// Every row gets its KV back and holds exactly its reference.
    fn check_all(&mut self) {
        self.rows.settle().unwrap();
        for (i, r) in self.reference.iter().enumerate() {
            assert_holds(self.rows.row(i).unwrap(), r);
        }
    }
}

/// Row attention alone, from the formula: `softmax(q kᵀ · scale) v` with grouped heads,
/// on the host.
fn alone_attention(q: &Array, k: &Array, v: &Array) -> Vec<f32> {
    let (q, k, v) = (
        q.to_vec::<f32>().unwrap(),
        k.to_vec::<f32>().unwrap(),
        v.to_vec::<f32>().unwrap(),
    );
    let d = DIM as usize;
    let t = k.len() / (HEADS as usize * d);
    let rep = (QUERY_HEADS / HEADS) as usize;
    let mut out = Vec::with_capacity(q.len());
    for h in 0..QUERY_HEADS as usize {
        let kv = h / rep;
        let qh = &q[h * d..(h + 1) * d];
        let scores: Vec<f32> = (0..t)
            .map(|j| {
                let kj = &k[(kv * t + j) * d..(kv * t + j + 1) * d];
                qh.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>() * SCALE
            })
            .collect();
        let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = scores.iter().map(|s| (s - m).exp()).collect();
        let z: f32 = e.iter().sum();
        for x in 0..d {
            out.push(
                (0..t)
                    .map(|j| e[j] / z * v[(kv * t + j) * d + x])
                    .sum::<f32>(),
            );
        }
    }
    out
}

/// Asserts that `c` holds exactly the reference KV (bit for bit), with its pools.
fn assert_holds(c: &PagedKvCache, reference: &[(Array, Array)]) {
    assert!(!c.is_lent());
    for (l, (rk, rv)) in reference.iter().enumerate() {
        let (k, v) = c.fetch(l).unwrap().unwrap();
        assert_eq!(c.layer_offset(l), rk.shape()[2] as usize, "layer {l}");
        assert_eq!(k.shape(), rk.shape());
        assert_eq!(k.to_vec::<f32>().unwrap(), rk.to_vec::<f32>().unwrap());
        assert_eq!(v.to_vec::<f32>().unwrap(), rv.to_vec::<f32>().unwrap());
    }
}

#[test]
fn rows_of_very_different_lengths_share_one_arena_and_attend_as_alone() {
    let mut t = Twin::new();
    for n in [3, 300, 41, 1] {
        t.push(n);
    }
    for _ in 0..6 {
        t.step();
        assert!(t.rows.has_arena(), "rows of any lengths share an arena");
    }
    // 4 slots of 512 columns (the ladder's rung for 301 tokens and the next one).
    assert_eq!(t.rows.device_bytes(), 4 * 512 * PER_TOKEN);
    for i in 0..4 {
        assert!(t.rows.row(i).unwrap().is_lent());
    }
    t.check_all();
}

#[test]
fn joins_and_leaves_in_every_order_keep_every_row_exact() {
    let mut t = Twin::new();
    for n in [20, 7, 33] {
        t.push(n);
    }
    t.step();
    assert!(t.rows.has_arena());
    // The first row leaves, then a short row joins into its slot.
    t.filter(&[1, 2]);
    t.step();
    t.push(5);
    t.step();
    // A middle row leaves; a row longer than the arena's 256 columns joins.
    t.filter(&[0, 2]);
    t.step();
    t.push(400);
    assert!(
        t.rows.has_arena(),
        "a row longer than the columns grows them"
    );
    t.step();
    // The last row leaves, two join, the rows are reordered.
    t.filter(&[0, 1]);
    t.step();
    t.push(2);
    t.push(90);
    t.step();
    t.filter(&[3, 0, 2, 1]);
    t.step();
    t.step();
    assert!(t.rows.has_arena());
    for i in 0..t.rows.len() {
        assert!(t.rows.row(i).unwrap().is_lent());
    }
    // Every row leaves at once; the arena goes.
    t.filter(&[]);
    assert!(!t.rows.has_arena());
    assert_eq!(t.rows.device_bytes(), 0);
    // The batch goes on without an arena until a step plans one.
    t.push(12);
    t.step();
    assert!(t.rows.has_arena());
    t.check_all();
}

#[test]
fn a_join_and_a_leave_copy_one_row_whatever_the_batch() {
    for rows in [3, 7] {
        let mut t = Twin::new();
        for i in 0..rows {
            t.push(100 + i);
        }
        t.step();
        let built = t.rows.arena_copied_bytes();
        // The build copies each row's KV in once.
        let tokens: u64 = (0..rows).map(|i| 100 + i as u64).sum();
        assert_eq!(built, tokens * PER_TOKEN);
        // A row of 50 tokens joins a free slot: its KV, nothing else.
        t.push(50);
        assert_eq!(
            t.rows.arena_copied_bytes() - built,
            50 * PER_TOKEN,
            "{rows} rows"
        );
        t.step();
        // The first row (100 tokens, 2 decoded) leaves: its KV, nothing else.
        let before = t.rows.arena_copied_bytes();
        let keep: Vec<usize> = (1..=rows as usize).collect();
        t.filter(&keep);
        assert_eq!(t.rows.arena_copied_bytes() - before, 102 * PER_TOKEN);
        t.step();
        t.check_all();
    }
}

/// Row lengths, tokens each reserves, allowance in tokens, (slots, columns), steps in
/// the arena.
type Case = (&'static [i32], u64, u64, (u64, u64), usize);

#[test]
fn a_slot_arena_stays_within_its_reservations_and_the_allowance() {
    // (row lengths, tokens each reserves, allowance in tokens, slots and columns of the
    // arena, steps of 12 in it). 3 rows reserving 260 tokens fit 3 slots × 256 columns
    // (768 ≤ 780) but not 4 (1,024) without 244 tokens of allowance; at the 5th step the
    // longest row needs 257 columns, the next rung is 512, and only an unbounded allowance
    // lets it grow. Rows reserving 255 tokens each (765 < 768) get no arena.
    let cases: [Case; 4] = [
        (&[250, 252, 251], 260, 0, (3, 256), 4),
        (&[250, 252, 251], 260, 244, (4, 256), 4),
        (&[250, 252, 251], 260, u64::MAX / PER_TOKEN, (4, 512), 12),
        (&[240, 242, 241], 255, 0, (0, 0), 0),
    ];
    for (lens, reserve, allowance, (slots, cols), arena_steps) in cases {
        let (reserve, allowance) = (reserve * PER_TOKEN, allowance * PER_TOKEN);
        let mut t = Twin::new();
        t.rows.set_arena_allowance(allowance);
        for &n in lens {
            t.push_reserved(n, reserve);
        }
        let reserved = lens.len() as u64 * reserve;
        let mut in_arena = 0;
        for s in 0..12 {
            t.step();
            if t.rows.has_arena() {
                in_arena += 1;
                let bytes = t.rows.device_bytes();
                assert!(
                    bytes <= reserved.saturating_add(allowance),
                    "step {s}: {bytes} bytes"
                );
                assert_eq!(t.rows.arena_excess_bytes(), bytes.saturating_sub(reserved));
                for i in 0..t.rows.len() {
                    assert_eq!(t.rows.row(i).unwrap().device_bytes(), 0);
                }
            } else {
                assert_eq!(t.rows.arena_excess_bytes(), 0);
            }
            if s + 1 == arena_steps {
                assert_eq!(t.rows.device_bytes(), slots * cols * PER_TOKEN, "{lens:?}");
            }
        }
        assert_eq!(in_arena, arena_steps, "{lens:?}, allowance {allowance}");
        t.check_all();
    }
}

#[test]
fn the_ladders_pad_slots_and_columns_by_bounded_shares() {
    let slots: Vec<usize> = (1..=33).map(super::slot_rung).collect();
    assert_eq!(&slots[..9], &[1, 2, 4, 4, 6, 6, 8, 8, 12]);
    assert_eq!(
        (slots[15], slots[16], slots[23], slots[32]),
        (16, 24, 24, 48)
    );
    let rungs: Vec<usize> = [1, 256, 257, 1025, 1281, 4097, 4865]
        .iter()
        .map(|&c| super::column_rung(c))
        .collect();
    assert_eq!(rungs, [256, 256, 512, 1280, 1792, 4864, 6144]);
    for c in 1025..20_000 {
        let r = super::column_rung(c);
        assert!(
            r >= c && r.is_multiple_of(256) && (r as f64) < c as f64 * 1.25 + 256.0,
            "{c}: {r}"
        );
    }
}
