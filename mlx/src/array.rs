//! [`Array`]: an owned handle to one MLX array, and its host-buffer conversions.

use cxx::UniquePtr;

use crate::error::check;
use crate::ffi::ffi;
use crate::{Dtype, Element, Error, Result};

/// An MLX array: a node of MLX's lazy graph. Cloning is cheap: the clone is a second handle
/// to the same node (same buffer, same pending computation); ops build new nodes and
/// [`Array::eval`] computes them.
///
/// `Send` but not `Sync`; see the argument below for what that allows.
pub struct Array {
    pub(crate) raw: UniquePtr<ffi::Array>,
}

// SAFETY: the whole argument for sending arrays between threads; every crossing in the
// workspace is listed here and must stay within these rules.
//
// What a handle is. `Array` owns one `std::shared_ptr<mlx::core::array>`; the C++ `array` is
// itself a `shared_ptr` to an `ArrayDesc` (shape, dtype, buffer, primitive, inputs). Copying
// or dropping either pointer touches only atomic reference counts, so moving a handle to
// another thread, and dropping it there, is sound on its own.
//
// What is not thread-safe. Evaluating a node writes its `ArrayDesc` (it allocates the buffer,
// then detaches the inputs), and reading a node's data or graph reads that same
// descriptor, without locks. `Clone` and every op that takes an input share descriptors
// between handles. So two threads may not use handles to one unevaluated node (or to nodes
// whose graphs still share an unevaluated input) at overlapping times. `Array` is `!Sync`,
// which forbids sharing one handle; it does not see clones. The rule the code keeps instead:
//
//   An array crosses to another thread only (a) by moving every handle to its graph that
//   will be used again, or (b) once evaluated, when the other side only reads it or drops it.
//
// The crossings today (engine/src/scheduler.rs spawns the threads; docs/architecture.md has
// the thread model):
//
// 1. Model weights: loaded on the thread that calls `engine::load`, each dense tensor
//    evaluated there (`Weights::finish` in engine/src/weights.rs); quantized tensors kept
//    as stored may still be lazy loads. The loader's own handles drop when `load` returns,
//    so every handle used again is inside the `Model` (tied weights included), and
//    `Engine::open` moves the `Model` into the `kvstore-engine` thread with the worker
//    (rule a).
// 2. KV caches and the layer states of hybrid models (cache/src/state.rs, with their
//    rewind history of array handles): built, written, read, forked, rewound and published
//    only on the engine thread. The
//    device pool of finished sequences (`ResidentPool`, cache/src/resident.rs) lives in
//    `KvTiers` behind a `Mutex`, and `KvTiers` is shared (`Arc`) with the `kvstore-io-N`
//    I/O workers and the HTTP runtime; those read only token ids and byte counts through the
//    lock (`peek`, `stats`), never an array. At shutdown `Engine::shutdown` joins the engine
//    thread before the last `Arc<KvTiers>` can drop, so the pool's arrays are dropped, on
//    whatever thread that is, after their last use (rule a). MLX's own scheduler threads
//    keep their own references to arrays they are still computing.
// 3. Host blocks (`store::Block`: plane bytes) cross between the engine thread, the
//    `kvstore-io-N` I/O workers and the store's writer threads; arrays are made from host blocks
//    on the engine thread only (cache/src/host.rs).
// 4. Publication (cache/src/export.rs, engine/src/export.rs): the engine thread gathers
//    the new blocks of a cache into fresh arrays and calls `async_eval` on them, which
//    detaches every scheduled array from its inputs before it returns; the layer states a
//    snapshot block carries are evaluated (`eval`) there first. The `Export` holding the only
//    handles to the gathers, and clones of the evaluated states, moves to the
//    `kvstore-export` thread, which waits for the gathers (`eval` of a scheduled array only
//    waits on its event) and reads them and the states to host bytes, then drops them.
//    The gathers share no node with anything the engine thread uses (rule a); the states
//    are evaluated and only read (rule b).
// 5. The HTTP runtime receives events (token ids, text, counts), never an array.
//
// Tests and single-sequence `generate` keep arrays on one thread.
unsafe impl Send for Array {}

impl Array {
    pub(crate) fn wrap(
        op: &'static str,
        r: std::result::Result<UniquePtr<ffi::Array>, cxx::Exception>,
    ) -> Result<Array> {
        let raw = check(op, r)?;
        if raw.is_null() {
            return Err(Error::Mlx {
                op,
                message: "returned a null array".into(),
            });
        }
        Ok(Array { raw })
    }

    pub(crate) fn inner(&self) -> &ffi::Array {
        // `wrap` never stores a null pointer.
        self.raw.as_ref().expect("Array holds a null handle")
    }

    /// Copies a host slice into a new array of the given shape (row-major).
    pub fn from_slice<T: Element>(data: &[T], shape: &[i32]) -> Result<Array> {
        Self::from_bytes(bytemuck::cast_slice(data), shape, T::DTYPE)
    }

    /// Copies raw little-endian host bytes into a new array of the given shape and dtype.
    pub fn from_bytes(bytes: &[u8], shape: &[i32], dtype: Dtype) -> Result<Array> {
        Self::wrap(
            "from_bytes",
            ffi::array_from_bytes(bytes, shape, dtype.code()),
        )
    }

    /// A 0-d array holding `value` converted to `dtype`.
    pub fn scalar(value: f64, dtype: Dtype) -> Result<Array> {
        Self::wrap("scalar", ffi::array_scalar(value, dtype.code()))
    }

    /// Evaluates the array and copies its elements to the host; `T` must match the dtype.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        let actual = self.dtype();
        if actual != T::DTYPE {
            return Err(Error::DtypeMismatch {
                expected: T::DTYPE,
                actual,
            });
        }
        let bytes = self.to_bytes()?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }

    /// Evaluates the array and copies its elements to the host as row-major bytes.
    ///
    /// An array that is already evaluated and row-contiguous is copied without building a
    /// graph node, so concurrent reads of one immutable array are safe.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.nbytes()];
        self.read_into(&mut out)?;
        Ok(out)
    }

    /// Evaluates the array and copies its elements, row-major, into `out`, which must be
    /// exactly [`Self::nbytes`] long (a caller-owned buffer: nothing is allocated).
    pub fn read_into(&self, out: &mut [u8]) -> Result<()> {
        check("read_into", ffi::array_read_into(self.inner(), out))
    }

    /// The dimensions of the array.
    pub fn shape(&self) -> Vec<i32> {
        // Reading a field of the descriptor cannot throw.
        check("shape", ffi::array_shape(self.inner())).unwrap_or_default()
    }

    /// The number of dimensions.
    pub fn ndim(&self) -> usize {
        self.shape().len()
    }

    /// The number of elements.
    pub fn size(&self) -> usize {
        self.shape().iter().map(|&d| d as usize).product()
    }

    /// The element type.
    pub fn dtype(&self) -> Dtype {
        check("dtype", ffi::array_dtype(self.inner()))
            .and_then(Dtype::from_code)
            .unwrap_or(Dtype::F32)
    }

    /// Bytes the elements take (size × element size), whether or not evaluated.
    pub fn nbytes(&self) -> usize {
        check("nbytes", ffi::array_nbytes(self.inner())).unwrap_or(0)
    }

    /// Bytes of the allocator buffer behind an evaluated array, 0 before it is evaluated.
    /// At least [`Self::nbytes`] for an array of its own: MLX's buffer cache hands a new
    /// array a freed buffer less than two pages (and less than twice the size) larger than
    /// asked for, which the array then holds whole; a view reports its whole base buffer.
    pub fn buffer_bytes(&self) -> usize {
        check("buffer_bytes", ffi::array_buffer_bytes(self.inner())).unwrap_or(0)
    }

    /// Address of the first element of an evaluated array. Used to check buffer donation
    /// (an in-place update keeps the address); an unevaluated array is an error.
    pub fn data_addr(&self) -> Result<usize> {
        check("data_addr", ffi::array_data_addr(self.inner()))
    }

    /// Computes the array (and everything it depends on) now.
    pub fn eval(&self) -> Result<()> {
        crate::eval(&[self])
    }

    /// Whether `other` is a handle to this very array node (not merely equal values).
    pub fn same_node(&self, other: &Array) -> bool {
        ffi::array_same_node(self.inner(), other.inner())
    }

    /// Whether this array's value is computed (without waiting): false while it is not
    /// queued yet or its kernels still run.
    pub fn is_available(&self) -> bool {
        ffi::array_is_available(self.inner())
    }

    /// Reads a single-element array as f32 (converting its dtype).
    pub fn item_f32(&self) -> Result<f32> {
        let v = self.astype(Dtype::F32)?.to_vec::<f32>()?;
        v.first().copied().ok_or(Error::InvalidArgument {
            op: "item_f32",
            message: "array is empty".into(),
        })
    }

    /// Reads a single-element array as i32 (converting its dtype).
    pub fn item_i32(&self) -> Result<i32> {
        let v = self.astype(Dtype::I32)?.to_vec::<i32>()?;
        v.first().copied().ok_or(Error::InvalidArgument {
            op: "item_i32",
            message: "array is empty".into(),
        })
    }
}

/// Host bytes that become an array's storage without a copy where MLX computes on the
/// host: [`HostBuffer::into_array`] hands the buffer to MLX, which frees it (once) when the
/// array's data is released. Built for bulk imports (a restore assembles each layer's KV
/// straight into one of these). The memory comes from MLX's allocator, so it counts in
/// MLX's memory figures.
///
/// Where the default device is a GPU, [`HostBuffer::into_array`] uploads the bytes as
/// [`Array::from_bytes`] does (one driver copy on CUDA) and frees the buffer.
pub struct HostBuffer {
    raw: UniquePtr<ffi::HostBuffer>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain host memory owned by this value alone (no array or other
// handle points into it until `into_array` gives it away); moving it to another thread and
// freeing it there is sound, as for a `Vec<u8>`. MLX's allocator is thread-safe.
unsafe impl Send for HostBuffer {}

impl HostBuffer {
    /// `len` zeroed bytes.
    pub fn new(len: usize) -> Result<HostBuffer> {
        let raw = check("host_buffer", ffi::host_buffer_new(len))?;
        let Some(b) = raw.as_ref() else {
            return Err(Error::Mlx {
                op: "host_buffer",
                message: "returned a null buffer".into(),
            });
        };
        let ptr = ffi::host_buffer_addr(b) as *mut u8;
        Ok(HostBuffer { raw, ptr, len })
    }

    /// Bytes in the buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The array of `shape` and `dtype` (row-major) whose elements are these bytes, which
    /// must be exactly as many as the shape and dtype need. On the CPU the array takes the
    /// buffer over (no copy); on a GPU the bytes are uploaded.
    pub fn into_array(self, shape: &[i32], dtype: Dtype) -> Result<Array> {
        if crate::default_device()? == crate::Device::Gpu {
            return Array::from_bytes(&self, shape, dtype);
        }
        Array::wrap(
            "from_host_buffer",
            ffi::array_from_host_buffer(self.raw, shape, dtype.code()),
        )
    }

    /// Host buffers allocated and not yet freed, in this process (by their owner or by the
    /// array that took them over). For tests of ownership.
    pub fn live() -> usize {
        ffi::host_buffers_live()
    }
}

impl std::ops::Deref for HostBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialized (zeroed at allocation) bytes this value
        // owns until drop or `into_array`, both of which consume it.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for HostBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer")
            .field("len", &self.len)
            .finish()
    }
}

impl Clone for Array {
    /// A second handle to the same array node (no copy of the data).
    fn clone(&self) -> Self {
        // Copying a shared_ptr cannot throw except on allocation failure, which aborts
        // in Rust as well.
        Array::wrap("clone", ffi::array_clone(self.inner())).expect("cloning an MLX array handle")
    }
}

impl std::fmt::Debug for Array {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Array")
            .field("shape", &self.shape())
            .field("dtype", &self.dtype())
            .finish()
    }
}

/// Builds an MLX list of arrays (also used for an optional array: empty or one).
pub(crate) fn list(op: &'static str, arrays: &[&Array]) -> Result<UniquePtr<ffi::ArrayList>> {
    let mut l = check(op, ffi::list_new())?;
    for a in arrays {
        check(op, ffi::list_push(l.pin_mut(), a.inner()))?;
    }
    Ok(l)
}

/// Reads every array out of an MLX list.
pub(crate) fn unlist(op: &'static str, l: &ffi::ArrayList) -> Result<Vec<Array>> {
    let n = check(op, ffi::list_len(l))?;
    (0..n)
        .map(|i| Array::wrap(op, ffi::list_get(l, i)))
        .collect()
}

/// Rows of host bytes for [`write_rows_direct`]: `height` rows of `width` bytes,
/// consecutive in `src`, to go at a pitch of `pitch` bytes from the start of `dst`'s data.
pub struct RowsWrite<'a> {
    /// The array written (see [`write_rows_direct`] for what it must be).
    pub dst: &'a Array,
    /// The rows, `width · height` bytes.
    pub src: &'a [u8],
    /// Bytes of a row.
    pub width: usize,
    /// Rows.
    pub height: usize,
    /// Bytes from one row's start in `dst` to the next one's.
    pub pitch: usize,
}

/// Copies each write's rows into its array's CUDA memory: through the driver into device
/// memory (one copy each, queued together and waited for before returning), by the host
/// where MLX's allocator gave the array managed memory (it reuses a host upload's freed
/// buffer for a kernel's output); `Ok(false)`, nothing copied, where direct transfers are
/// unavailable (no CUDA) or an array has no buffer.
/// MLX does not see the writes: each array must be evaluated, row-contiguous and held by
/// the caller alone with nothing queued on it, as the arrays of [`zeroed_on_device`] are.
pub fn write_rows_direct(writes: &[RowsWrite<'_>]) -> Result<bool> {
    let dsts: Vec<&Array> = writes.iter().map(|w| w.dst).collect();
    let l = list("write_rows_direct", &dsts)?;
    let at: Vec<usize> = writes
        .iter()
        .flat_map(|w| {
            [
                w.src.as_ptr() as usize,
                w.src.len(),
                w.width,
                w.height,
                w.pitch,
            ]
        })
        .collect();
    // The sources stay borrowed until the copies have finished (the call waits for them).
    check("write_rows_direct", ffi::arrays_write_rows(&l, &at))
}

/// Zero-filled arrays of the given shapes and dtypes, computed in one evaluation, each with
/// a buffer of its own: destinations for [`write_rows_direct`]. On a GPU the fills run on a
/// stream of the calling thread's own, so waiting for them does not wait for the kernels
/// queued on the default stream before them (an engine's decode step queued one step
/// ahead: a restore inside a serving step would otherwise stall it a whole step).
pub fn zeroed_on_device(shapes: &[(&[i32], Dtype)]) -> Result<Vec<Array>> {
    let dims: Vec<i32> = shapes.iter().flat_map(|(s, _)| s.iter().copied()).collect();
    let ranks: Vec<usize> = shapes.iter().map(|(s, _)| s.len()).collect();
    let dtypes: Vec<u8> = shapes.iter().map(|(_, d)| d.code()).collect();
    let list = check(
        "zeroed_on_device",
        ffi::zeroed_off_queue(&dims, &ranks, &dtypes),
    )?;
    unlist("zeroed_on_device", &list)
}

/// Computes all the given arrays now, sharing work between their graphs.
pub fn eval(arrays: &[&Array]) -> Result<()> {
    let l = list("eval", arrays)?;
    check("eval", ffi::eval(&l))
}

/// Starts computing the given arrays in the background; a later read or eval waits.
pub fn async_eval(arrays: &[&Array]) -> Result<()> {
    let l = list("async_eval", arrays)?;
    check("async_eval", ffi::async_eval(&l))
}

/// Waits until everything queued on the default device's default stream has run and
/// MLX has released what its kernels held (their completion callbacks ran). After it, an
/// array no queued kernel reads any more can be updated in place (MLX's CUDA backend holds
/// a kernel's inputs until its callback; an `eval` returns once the result is computed,
/// possibly before).
pub fn synchronize() -> Result<()> {
    check("synchronize", ffi::synchronize())
}

/// The name the graph walk of the shim lists a small computed input under.
const SMALL_LEAF: &str = "(small leaf)";

/// The walk of the shim: pending primitives' names, one per primitive, and [`SMALL_LEAF`]
/// once per small computed input of a pending node.
fn pending_walk(arrays: &[&Array]) -> Result<Vec<String>> {
    let l = list("pending_primitives", arrays)?;
    check("pending_primitives", ffi::pending_primitives(&l))
}

/// What an eval of `arrays` would run now: the name of each pending node's primitive (MLX's
/// names, e.g. `Add`, `Matmul`, `Slice`), one per primitive, in no particular order. Views
/// (`Slice`, `Reshape`, `Transpose`, ...) are nodes too, though a GPU runs no kernel for
/// most of them. A census of a step's graph, for a step bound by launching its kernels.
pub fn pending_primitives(arrays: &[&Array]) -> Result<Vec<String>> {
    let mut names = pending_walk(arrays)?;
    names.retain(|n| n != SMALL_LEAF);
    Ok(names)
}

/// How many computed inputs of at most 64 bytes the pending nodes of `arrays` read (each
/// once): mostly constants the host made for the graph (a scalar operand; an integer RoPE
/// offset, which MLX turns into an array at each call), whose bytes MLX's CUDA backend keeps
/// in managed memory; also small results of earlier graphs (a previous step's pick).
pub fn pending_small_leaves(arrays: &[&Array]) -> Result<usize> {
    Ok(pending_walk(arrays)?
        .iter()
        .filter(|n| *n == SMALL_LEAF)
        .count())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_array_is_available_once_computed() {
        let a = Array::from_slice(&[1.0f32, 2.0], &[2]).unwrap();
        let b = a.add(&a).unwrap();
        assert!(!b.is_available(), "not queued");
        b.eval().unwrap();
        assert!(b.is_available());
    }

    #[test]
    fn the_pending_census_names_each_unrun_node_once_and_forgets_what_ran() {
        let a = Array::from_slice(&[1.0f32, 2.0], &[2]).unwrap();
        let b = Array::from_slice(&[3.0f32, 4.0], &[2]).unwrap();
        let sum = a.add(&b).unwrap();
        // `sum` feeds both outputs: one Add, counted once.
        let (x, y) = (sum.mul(&a).unwrap(), sum.sub(&b).unwrap());
        let mut names = pending_primitives(&[&x, &y]).unwrap();
        names.sort();
        assert_eq!(names, ["Add", "Multiply", "Subtract"]);
        assert_eq!(
            pending_small_leaves(&[&x, &y]).unwrap(),
            2,
            "a and b, once each"
        );
        sum.eval().unwrap();
        let mut names = pending_primitives(&[&x, &y]).unwrap();
        names.sort();
        assert_eq!(
            names,
            ["Multiply", "Subtract"],
            "the evaluated Add is not pending"
        );
        assert_eq!(
            pending_small_leaves(&[&x, &y]).unwrap(),
            3,
            "its result is a small input now"
        );
        let big = Array::from_slice(&[0.0f32; 17], &[17]).unwrap();
        let z = big.add(&big).unwrap();
        assert_eq!(
            pending_small_leaves(&[&z]).unwrap(),
            0,
            "68 bytes is not small"
        );
        eval(&[&x, &y]).unwrap();
        assert!(pending_primitives(&[&x, &y]).unwrap().is_empty());
        assert!(
            pending_primitives(&[&a]).unwrap().is_empty(),
            "data has no primitive"
        );
    }

    #[test]
    fn an_adopted_host_buffer_is_read_in_place_and_freed_once_with_the_array() {
        // The only test of this binary that makes host buffers: the live count is ours.
        let before = HostBuffer::live();
        let values: Vec<f32> = (0..24).map(|i| i as f32 * 0.5 - 3.0).collect();
        let mut b = HostBuffer::new(values.len() * 4).unwrap();
        assert!(b.iter().all(|&x| x == 0), "a new buffer is zeroed");
        b.copy_from_slice(bytemuck::cast_slice(&values));
        let addr = b.as_ptr() as usize;
        assert_eq!(HostBuffer::live(), before + 1);
        let a = b.into_array(&[2, 3, 4], Dtype::F32).unwrap();
        // Taken over, not copied (on the CPU), and still counted as live.
        if crate::default_device().unwrap() == crate::Device::Cpu {
            a.eval().unwrap();
            assert_eq!(a.data_addr().unwrap(), addr);
            assert_eq!(HostBuffer::live(), before + 1);
        }
        assert_eq!(a.to_vec::<f32>().unwrap(), values);
        // A second handle keeps the buffer; the last one frees it.
        let b2 = a.clone();
        let plus = a.add_scalar(1.0).unwrap();
        drop(a);
        let want: Vec<f32> = values.iter().map(|v| v + 1.0).collect();
        assert_eq!(plus.to_vec::<f32>().unwrap(), want);
        assert_eq!(b2.to_vec::<f32>().unwrap(), values);
        drop((b2, plus));
        assert_eq!(HostBuffer::live(), before);
        // Dropped without being handed over: freed by its owner.
        drop(HostBuffer::new(1000).unwrap());
        assert_eq!(HostBuffer::live(), before);
        // A shape that does not match the bytes is an error, and the buffer is freed.
        let b = HostBuffer::new(12).unwrap();
        assert!(b.into_array(&[4], Dtype::F32).is_err());
        assert_eq!(HostBuffer::live(), before);
        // Empty.
        let e = HostBuffer::new(0)
            .unwrap()
            .into_array(&[0, 3], Dtype::F32)
            .unwrap();
        assert!(e.to_vec::<f32>().unwrap().is_empty());
        drop(e);
        assert_eq!(HostBuffer::live(), before);
    }
}
