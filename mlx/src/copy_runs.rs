//! Copies of token runs of several arrays as one graph node (the shim's `CopyTokenRuns`,
//! `copy_runs.cc`): what a publication takes of every layer part of a sequence's arenas.
//!
//! Each copy as a view and a `contiguous` costs the thread that builds the graph MLX's
//! per-node time, ~64 copies for a 32-layer model's publication (~1.3 ms on the H100 under
//! the trace, docs/benchmarks.md session 43). The node takes every part at once: on CUDA one
//! kernel per 32 parts, on the CPU one task on the CPU stream's thread. On a GPU the node is
//! opt-in until measured ([`copy_runs_on_gpu`]); without it (and on Metal) each part is
//! copied on its own as before.

use std::sync::Arc;

use crate::array::{list, unlist, Array};
use crate::ffi::ffi;
use crate::{Device, Dtype, Result};

/// One source of [`copy_token_runs`]: tokens `lo..hi` (axis 2) of a 4-D `[A, H, T, W]`
/// array whose last axis is contiguous.
#[derive(Clone, Copy, Debug)]
pub struct TokenRun<'a> {
    /// The array copied from.
    pub source: &'a Array,
    /// The first token copied.
    pub lo: usize,
    /// One past the last token copied.
    pub hi: usize,
}

/// Whether this build has the GPU kernel (built against the CUDA backend's headers); the
/// CPU's evaluation is in every build.
pub fn copy_runs_kernel_built() -> bool {
    ffi::copy_runs_kernel_built()
}

/// Whether [`copy_token_runs`] copies on a GPU in one node: the kernel is built and
/// `KVSTORE_COPY_RUNS=0` is not set (read once). On an H100 (session 45) its copies were
/// byte-identical to the per-part ones for every tensor of 200 published blocks, and the
/// trace's cache arm ran at 0.92x the per-part build's TTFT P50 and 0.87x its P99
/// (docs/benchmarks.md).
pub fn copy_runs_on_gpu() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        copy_runs_kernel_built() && std::env::var("KVSTORE_COPY_RUNS").map_or(true, |v| v != "0")
    })
}

/// Copies of `runs`, in order: output i is `runs[i].source[:, :, lo..hi, :]`, row-major in
/// fresh memory (the node's outputs share one new buffer without overlapping), so later
/// writes to the source (in place or not) never reach it.
/// One graph node for all of them where the default device has the node's evaluation (the
/// CPU, or a CUDA build with the kernel not switched off: [`copy_runs_on_gpu`]); a copy each
/// elsewhere.
pub fn copy_token_runs(runs: &[TokenRun<'_>]) -> Result<Vec<Array>> {
    if runs.is_empty() {
        return Ok(Vec::new());
    }
    if crate::default_device()? == Device::Gpu && !copy_runs_on_gpu() {
        return runs.iter().map(copy_one_run).collect();
    }
    let sources: Vec<&Array> = runs.iter().map(|r| r.source).collect();
    let l = list("copy_token_runs", &sources)?;
    let ranges: Vec<i64> = runs
        .iter()
        .flat_map(|r| [r.lo as i64, r.hi as i64])
        .collect();
    let out = crate::error::check("copy_token_runs", ffi::copy_token_runs(&l, &ranges))?;
    unlist("copy_token_runs", &out)
}

/// One run of [`copy_token_runs_to_host`]: tokens `lo..hi` (axis 2) of source `source` (an
/// index into its sources), written row-major at host address `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostRun {
    /// The source, by its index.
    pub source: usize,
    /// The first token copied.
    pub lo: usize,
    /// One past the last token copied.
    pub hi: usize,
    /// Where the run's rows go, in host memory.
    pub dst: u64,
}

/// Bytes of [`copy_token_runs_to_host`]'s table per run (the shim's `Run`).
pub const HOST_RUN_TABLE_ENTRY: usize = 64;

/// A node that writes `runs` of `sources` straight into host memory: run i's rows (the
/// source's tokens `lo..hi`, every leading index, row-major, as [`copy_token_runs`] lays
/// out its outputs) at its `dst`. The returned array is 16 bytes of nothing: once it is
/// evaluated the writes are done. On CUDA one kernel reads the runs from `table` (filled
/// when the node runs) and writes over the bus; on the CPU the CPU stream's thread copies.
/// `owner` is kept until the node has written (or is dropped unevaluated); runs outside
/// their source are refused here.
///
/// # Safety
///
/// Every `dst` must point to at least its run's bytes, and `table` to
/// `runs.len()` · [`HOST_RUN_TABLE_ENTRY`] bytes, all memory that `owner` keeps alive and
/// that nothing reads or writes until the returned array has been evaluated. On CUDA all of
/// it must be page-locked memory the device can address ([`crate::PinnedBuffer`] and memory
/// carved from one); on the CPU any memory.
pub unsafe fn copy_token_runs_to_host<O>(
    sources: &[&Array],
    runs: &[HostRun],
    table: *mut u8,
    table_len: usize,
    owner: Arc<O>,
) -> Result<Array>
where
    O: Send + Sync + 'static,
{
    let l = list("copy_token_runs_to_host", sources)?;
    let spans: Vec<i64> = runs
        .iter()
        .flat_map(|r| [r.source as i64, r.lo as i64, r.hi as i64])
        .collect();
    let dsts: Vec<u64> = runs.iter().map(|r| r.dst).collect();
    let token = crate::host_upload::lend("copy_token_runs_to_host", Box::new(owner))?;
    // From here the shim owns the lending: every outcome, an error included, releases it.
    Array::wrap(
        "copy_token_runs_to_host",
        ffi::copy_token_runs_to_host(&l, &spans, &dsts, table as usize, table_len, token),
    )
}

/// One run copied on its own, by the rule measured best for a GPU before the node (session
/// 42): a strided view made contiguous (one copy, no index array), or a gather by an index
/// made on the device where the view is row-contiguous already (one head, or all tokens),
/// since `contiguous` would then hand back the source's own buffer.
fn copy_one_run(r: &TokenRun<'_>) -> Result<Array> {
    let s = r.source.shape();
    if s.len() != 4 {
        return Err(crate::Error::Mlx {
            op: "copy_token_runs",
            message: "copy_token_runs takes 4-D sources [A, H, T, W]".into(),
        });
    }
    let strided = s[0] * s[1] > 1 && !(r.lo == 0 && r.hi == s[2] as usize);
    if strided {
        return r
            .source
            .slice(&[0, 0, r.lo as i32, 0], &[s[0], s[1], r.hi as i32, s[3]])?
            .contiguous();
    }
    let idx = crate::ops::arange(r.lo as f64, r.hi as f64, 1.0, Dtype::I32)?;
    r.source.take(&idx, 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `data` (row-major `[a, h, t, w]`) restricted to tokens `lo..hi`: the naive reference.
    fn tokens<T: Copy>(data: &[T], dims: [usize; 4], lo: usize, hi: usize) -> Vec<T> {
        let [a, h, t, w] = dims;
        let mut out = Vec::new();
        for i in 0..a * h {
            for tok in lo..hi {
                let at = (i * t + tok) * w;
                out.extend_from_slice(&data[at..at + w]);
            }
        }
        out
    }

    fn counting(n: usize) -> Vec<f32> {
        (0..n).map(|i| i as f32 * 0.5 - 7.0).collect()
    }

    #[test]
    fn each_output_is_its_sources_token_run() {
        // Parts of different widths and heads, as a quantized cache's data and scales are.
        let a = counting(2 * 9 * 8);
        let b = counting(3 * 9 * 2);
        let c = counting(4 * 16 * 5);
        let xa = Array::from_slice(&a, &[1, 2, 9, 8]).unwrap();
        let xb = Array::from_slice(&b, &[1, 3, 9, 2]).unwrap();
        let xc = Array::from_slice(&c, &[2, 2, 16, 5]).unwrap();
        let runs = [
            TokenRun {
                source: &xa,
                lo: 3,
                hi: 7,
            },
            TokenRun {
                source: &xb,
                lo: 0,
                hi: 9,
            },
            TokenRun {
                source: &xc,
                lo: 15,
                hi: 16,
            },
            TokenRun {
                source: &xa,
                lo: 4,
                hi: 4,
            },
        ];
        let out = copy_token_runs(&runs).unwrap();
        assert_eq!(out.len(), 4);
        assert_eq!(out[0].shape(), vec![1, 2, 4, 8]);
        assert_eq!(
            out[0].to_vec::<f32>().unwrap(),
            tokens(&a, [1, 2, 9, 8], 3, 7)
        );
        assert_eq!(
            out[1].to_vec::<f32>().unwrap(),
            tokens(&b, [1, 3, 9, 2], 0, 9)
        );
        assert_eq!(out[2].shape(), vec![2, 2, 1, 5]);
        assert_eq!(
            out[2].to_vec::<f32>().unwrap(),
            tokens(&c, [2, 2, 16, 5], 15, 16)
        );
        assert_eq!(out[3].shape(), vec![1, 2, 0, 8]);
        assert!(out[3].to_vec::<f32>().unwrap().is_empty());
        // The outputs share one buffer without overlapping: each starts past the last one.
        let spans: Vec<(usize, usize)> = out[..3]
            .iter()
            .map(|o| (o.data_addr().unwrap(), o.nbytes()))
            .collect();
        for w in spans.windows(2) {
            assert!(w[1].0 >= w[0].0 + w[0].1, "{spans:?}");
        }
        assert!(spans[2].0 - spans[0].0 < 1024, "one buffer: {spans:?}");
    }

    /// More runs than one CUDA launch takes (32), every source computed in the same graph as
    /// the node: each launch must wait for its own sources and for the zeros of the node's
    /// buffer. On a GPU with MLX's CUDA graphs the launches after the first were once roots of
    /// the graph and the later sources' runs came out wrong (session 48); on the CPU the
    /// stream runs in order and this checks the runs' placement only.
    #[test]
    fn runs_past_one_launch_wait_for_sources_computed_in_the_same_graph() {
        let n = 100;
        let data: Vec<Vec<f32>> = (0..n).map(|i| counting(2 * 16 * 8 + i)).collect();
        let sources: Vec<Array> = data
            .iter()
            .map(|d| {
                Array::from_slice(&d[..2 * 16 * 8], &[1, 2, 16, 8])
                    .unwrap()
                    .add(&Array::scalar(1.0, Dtype::F32).unwrap())
                    .unwrap()
            })
            .collect();
        let runs: Vec<TokenRun<'_>> = sources
            .iter()
            .enumerate()
            .map(|(i, s)| TokenRun {
                source: s,
                lo: i % 5,
                hi: 16 - i % 3,
            })
            .collect();
        let out = copy_token_runs(&runs).unwrap();
        let all: Vec<&Array> = out.iter().collect();
        crate::eval(&all).unwrap();
        for (i, o) in out.iter().enumerate() {
            let plus_one: Vec<f32> = data[i][..2 * 16 * 8].iter().map(|x| x + 1.0).collect();
            assert_eq!(
                o.to_vec::<f32>().unwrap(),
                tokens(&plus_one, [1, 2, 16, 8], i % 5, 16 - i % 3),
                "run {i}"
            );
        }
    }

    #[test]
    fn a_strided_view_and_16_bit_elements_are_copied_by_their_strides() {
        let data = counting(2 * 12 * 6);
        let big = Array::from_slice(&data, &[1, 2, 12, 6])
            .unwrap()
            .astype(Dtype::BF16)
            .unwrap();
        // Tokens 2..10 and features 0..4 of `big`: a view whose rows are not consecutive.
        let view = big.slice(&[0, 0, 2, 0], &[1, 2, 10, 4]).unwrap();
        let out = copy_token_runs(&[TokenRun {
            source: &view,
            lo: 1,
            hi: 6,
        }])
        .unwrap();
        let got = out[0].astype(Dtype::F32).unwrap().to_vec::<f32>().unwrap();
        let mut want = Vec::new();
        for h in 0..2 {
            for tok in 3..8 {
                let at = (h * 12 + tok) * 6;
                want.extend_from_slice(&data[at..at + 4]);
            }
        }
        assert_eq!(got, want);
    }

    #[test]
    fn the_copies_keep_what_the_source_held_when_they_were_taken() {
        let data = counting(2 * 4 * 4);
        let src = Array::from_slice(&data, &[1, 2, 4, 4]).unwrap();
        let out = copy_token_runs(&[TokenRun {
            source: &src,
            lo: 1,
            hi: 3,
        }])
        .unwrap();
        crate::eval(&[&out[0]]).unwrap();
        drop(src);
        assert_eq!(
            out[0].to_vec::<f32>().unwrap(),
            tokens(&data, [1, 2, 4, 4], 1, 3)
        );
    }

    /// The per-part copies a GPU without the node uses, run here on the CPU: the same tokens,
    /// and fresh memory also where the range is row-contiguous already.
    #[test]
    fn a_run_copied_on_its_own_is_its_tokens_in_fresh_memory() {
        let data = counting(2 * 6 * 4);
        let two_heads = Array::from_slice(&data, &[1, 2, 6, 4]).unwrap();
        let one_head = Array::from_slice(&data[..24], &[1, 1, 6, 4]).unwrap();
        crate::eval(&[&two_heads, &one_head]).unwrap();
        for (src, dims, lo, hi) in [
            (&two_heads, [1, 2, 6, 4], 1, 5),
            (&two_heads, [1, 2, 6, 4], 0, 6),
            (&one_head, [1, 1, 6, 4], 2, 4),
        ] {
            let out = copy_one_run(&TokenRun {
                source: src,
                lo,
                hi,
            })
            .unwrap();
            crate::eval(&[&out]).unwrap();
            assert_ne!(out.data_addr().unwrap(), src.data_addr().unwrap());
            let full: Vec<f32> = src.to_vec().unwrap();
            assert_eq!(out.to_vec::<f32>().unwrap(), tokens(&full, dims, lo, hi));
        }
    }

    #[test]
    fn a_range_outside_the_source_or_a_source_not_4_d_is_refused() {
        let src = Array::from_slice(&counting(8), &[1, 1, 2, 4]).unwrap();
        let e = copy_token_runs(&[TokenRun {
            source: &src,
            lo: 1,
            hi: 3,
        }])
        .unwrap_err();
        assert!(
            e.to_string().contains("tokens 1..3 of a source of 2"),
            "{e}"
        );
        let flat = Array::from_slice(&counting(8), &[2, 4]).unwrap();
        let e = copy_token_runs(&[TokenRun {
            source: &flat,
            lo: 0,
            hi: 1,
        }])
        .unwrap_err();
        assert!(e.to_string().contains("4-D"), "{e}");
        assert!(copy_token_runs(&[]).unwrap().is_empty());
    }

    /// Host memory a [`copy_token_runs_to_host`] node writes: one buffer per run and the
    /// table, kept by the node until it is done.
    struct HostBuffers {
        runs: Vec<std::cell::UnsafeCell<Vec<u8>>>,
        table: std::cell::UnsafeCell<Vec<u8>>,
    }
    // The node writes the buffers only while the test waits for it.
    unsafe impl Sync for HostBuffers {}
    unsafe impl Send for HostBuffers {}

    impl HostBuffers {
        fn new(lens: &[usize], runs: usize) -> Arc<Self> {
            Arc::new(Self {
                runs: lens
                    .iter()
                    .map(|&n| std::cell::UnsafeCell::new(vec![0xAB; n]))
                    .collect(),
                table: std::cell::UnsafeCell::new(vec![0; runs * HOST_RUN_TABLE_ENTRY]),
            })
        }
        fn dst(&self, i: usize) -> u64 {
            unsafe { (*self.runs[i].get()).as_mut_ptr() as u64 }
        }
        fn table(&self) -> (*mut u8, usize) {
            let t = unsafe { &mut *self.table.get() };
            (t.as_mut_ptr(), t.len())
        }
        fn bytes(&self, i: usize) -> Vec<u8> {
            unsafe { (*self.runs[i].get()).clone() }
        }
    }

    fn le_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn runs_written_to_host_memory_hold_their_sources_tokens_and_nothing_past_them() {
        // A publication's shape: every block of every part at its own host buffer; parts of
        // different widths and heads, and a run of no tokens that writes nothing.
        let a = counting(2 * 9 * 8);
        let b = counting(3 * 9 * 2);
        let xa = Array::from_slice(&a, &[1, 2, 9, 8]).unwrap();
        let xb = Array::from_slice(&b, &[1, 3, 9, 2]).unwrap();
        let runs = [(0, 0, 3), (0, 3, 6), (1, 3, 6), (1, 6, 9), (0, 4, 4)];
        let want: Vec<Vec<u8>> = runs
            .iter()
            .map(|&(s, lo, hi)| match s {
                0 => le_bytes(&tokens(&a, [1, 2, 9, 8], lo, hi)),
                _ => le_bytes(&tokens(&b, [1, 3, 9, 2], lo, hi)),
            })
            .collect();
        // One byte past each run's rows shows that the node writes no further.
        let lens: Vec<usize> = want.iter().map(|w| w.len() + 1).collect();
        let host = HostBuffers::new(&lens, runs.len());
        let list: Vec<HostRun> = runs
            .iter()
            .enumerate()
            .map(|(i, &(source, lo, hi))| HostRun {
                source,
                lo,
                hi,
                dst: host.dst(i),
            })
            .collect();
        let (table, table_len) = host.table();
        let done =
            unsafe { copy_token_runs_to_host(&[&xa, &xb], &list, table, table_len, host.clone()) }
                .unwrap();
        crate::eval(&[&done]).unwrap();
        drop(done);
        for (i, w) in want.iter().enumerate() {
            let got = host.bytes(i);
            assert_eq!(&got[..w.len()], &w[..], "run {i}");
            assert_eq!(got[w.len()], 0xAB, "run {i} wrote past its rows");
        }
        // The node gave its owner back once it had written.
        for _ in 0..100 {
            if Arc::strong_count(&host) == 1 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(Arc::strong_count(&host), 1);
    }

    #[test]
    fn a_host_run_outside_its_source_or_a_short_table_is_refused_and_its_owner_given_back() {
        let src = Array::from_slice(&counting(8), &[1, 1, 2, 4]).unwrap();
        let host = HostBuffers::new(&[64], 1);
        let (table, table_len) = host.table();
        let run = |source, lo, hi| HostRun {
            source,
            lo,
            hi,
            dst: host.dst(0),
        };
        let e = unsafe {
            copy_token_runs_to_host(&[&src], &[run(0, 1, 3)], table, table_len, host.clone())
        }
        .unwrap_err();
        assert!(
            e.to_string().contains("tokens 1..3 of a source of 2"),
            "{e}"
        );
        let e = unsafe {
            copy_token_runs_to_host(&[&src], &[run(1, 0, 1)], table, table_len, host.clone())
        }
        .unwrap_err();
        assert!(e.to_string().contains("names source 1 of 1"), "{e}");
        let e = unsafe {
            copy_token_runs_to_host(
                &[&src],
                &[run(0, 0, 1), run(0, 1, 2)],
                table,
                table_len,
                host.clone(),
            )
        }
        .unwrap_err();
        assert!(e.to_string().contains("a table of 64 bytes for 2"), "{e}");
        assert_eq!(Arc::strong_count(&host), 1);
    }
}
