//! Array operations: construction, shape, indexing, arithmetic, reductions, sorting.
//! Every op is lazy; nothing is computed until an eval or a host read.

use crate::array::{list, Array};
use crate::ffi::ffi::{self, BinaryOp, ReduceOp, UnaryOp};
use crate::{Dtype, Result};

/// An array of zeros.
pub fn zeros(shape: &[i32], dtype: Dtype) -> Result<Array> {
    Array::wrap("zeros", ffi::zeros(shape, dtype.code()))
}

/// An array filled with `value`.
pub fn full(shape: &[i32], value: f64, dtype: Dtype) -> Result<Array> {
    Array::wrap("full", ffi::full(shape, value, dtype.code()))
}

/// Evenly spaced values in `[start, stop)` with `step`.
pub fn arange(start: f64, stop: f64, step: f64, dtype: Dtype) -> Result<Array> {
    Array::wrap("arange", ffi::arange(start, stop, step, dtype.code()))
}

/// Joins arrays along an existing axis.
pub fn concatenate(arrays: &[&Array], axis: i32) -> Result<Array> {
    let l = list("concatenate", arrays)?;
    Array::wrap("concatenate", ffi::concatenate(&l, axis))
}

/// Stacks arrays along a new axis.
pub fn stack(arrays: &[&Array], axis: i32) -> Result<Array> {
    let l = list("stack", arrays)?;
    Array::wrap("stack", ffi::stack(&l, axis))
}

/// The most pieces MLX's `split` makes as one graph node: past it, MLX 0.32.4 makes a
/// `Slice` node per piece (a batched decode step of 16 rows split its queries, keys and
/// values that way in every layer: 1,050 more nodes a step, docs/benchmarks.md, session 22).
pub const SPLIT_NODE_PARTS: usize = 10;

/// `a` cut into `parts` equal pieces along `axis` (views): one graph node for up to
/// [`SPLIT_NODE_PARTS`] pieces; more are cut from slices of that many pieces each (a slice
/// and a split a group instead of a node a piece).
pub fn split(a: &Array, parts: usize, axis: i32) -> Result<Vec<Array>> {
    let shape = a.shape();
    let ax = if axis < 0 {
        axis + shape.len() as i32
    } else {
        axis
    };
    let len = usize::try_from(ax)
        .ok()
        .and_then(|i| shape.get(i))
        .map(|&d| d as usize);
    match len {
        Some(len) if parts > SPLIT_NODE_PARTS && len % parts == 0 => {
            let (ax, each) = (ax as usize, len / parts);
            let mut out = Vec::with_capacity(parts);
            for first in (0..parts).step_by(SPLIT_NODE_PARTS) {
                let k = SPLIT_NODE_PARTS.min(parts - first);
                let mut start = vec![0; shape.len()];
                let mut stop = shape.clone();
                start[ax] = (first * each) as i32;
                stop[ax] = ((first + k) * each) as i32;
                let group = a.slice(&start, &stop)?;
                if k == 1 {
                    out.push(group);
                } else {
                    out.extend(split_node(&group, k, axis)?);
                }
            }
            Ok(out)
        }
        // Up to the node's parts, and what MLX refuses (it says why).
        _ => split_node(a, parts, axis),
    }
}

/// MLX's own `split` into `parts` equal pieces.
fn split_node(a: &Array, parts: usize, axis: i32) -> Result<Vec<Array>> {
    let l = crate::error::check("split", ffi::split_equal(a.inner(), parts as i32, axis))?;
    crate::array::unlist("split", &l)
}

/// Picks `a` where `cond` is true, else `b` (broadcasting).
pub fn where_(cond: &Array, a: &Array, b: &Array) -> Result<Array> {
    Array::wrap("where", ffi::where_(cond.inner(), a.inner(), b.inner()))
}

macro_rules! unary_ops {
    ($($(#[$doc:meta])* $name:ident => $op:ident;)*) => {
        impl Array {
            $(
                $(#[$doc])*
                pub fn $name(&self) -> Result<Array> {
                    Array::wrap(stringify!($name), ffi::unary(UnaryOp::$op, self.inner()))
                }
            )*
        }
    };
}

unary_ops! {
    /// Element-wise negation.
    neg => Negative;
    /// Element-wise absolute value.
    abs => Abs;
    /// Element-wise e^x.
    exp => Exp;
    /// Element-wise natural logarithm.
    log => Log;
    /// Element-wise square root.
    sqrt => Sqrt;
    /// Element-wise 1/sqrt(x).
    rsqrt => Rsqrt;
    /// Element-wise x².
    square => Square;
    /// Element-wise tanh.
    tanh => Tanh;
    /// Element-wise logistic sigmoid.
    sigmoid => Sigmoid;
    /// Element-wise sine.
    sin => Sin;
    /// Element-wise cosine.
    cos => Cos;
    /// Element-wise logical not.
    logical_not => LogicalNot;
    /// SiLU: x · sigmoid(x).
    silu => Silu;
    /// GELU, tanh approximation: 0.5x(1 + tanh(√(2/π)(x + 0.044715x³))).
    gelu_tanh => GeluTanh;
}

macro_rules! binary_ops {
    ($($(#[$doc:meta])* $name:ident => $op:ident;)*) => {
        impl Array {
            $(
                $(#[$doc])*
                pub fn $name(&self, other: &Array) -> Result<Array> {
                    Array::wrap(stringify!($name), ffi::binary(BinaryOp::$op, self.inner(), other.inner()))
                }
            )*
        }
    };
}

binary_ops! {
    /// Element-wise sum (broadcasting).
    add => Add;
    /// Element-wise difference (broadcasting).
    sub => Subtract;
    /// Element-wise product (broadcasting).
    mul => Multiply;
    /// Element-wise quotient (broadcasting).
    div => Divide;
    /// Element-wise maximum (broadcasting).
    maximum => Maximum;
    /// Element-wise minimum (broadcasting).
    minimum => Minimum;
    /// Element-wise power (broadcasting).
    power => Power;
    /// Element-wise ==, boolean result.
    eq => Equal;
    /// Element-wise !=, boolean result.
    ne => NotEqual;
    /// Element-wise <, boolean result.
    lt => Less;
    /// Element-wise <=, boolean result.
    le => LessEqual;
    /// Element-wise >, boolean result.
    gt => Greater;
    /// Element-wise >=, boolean result.
    ge => GreaterEqual;
    /// Element-wise logical and.
    logical_and => LogicalAnd;
    /// Element-wise logical or.
    logical_or => LogicalOr;
}

macro_rules! reduce_ops {
    ($($(#[$doc:meta])* $name:ident => $op:ident;)*) => {
        impl Array {
            $(
                $(#[$doc])*
                pub fn $name(&self, axis: i32, keepdims: bool) -> Result<Array> {
                    Array::wrap(stringify!($name), ffi::reduce(ReduceOp::$op, self.inner(), axis, keepdims))
                }
            )*
        }
    };
}

reduce_ops! {
    /// Sum along an axis.
    sum => Sum;
    /// Mean along an axis.
    mean => Mean;
    /// Maximum along an axis.
    max => Max;
    /// Minimum along an axis.
    min => Min;
    /// Index of the maximum along an axis (uint32).
    argmax => Argmax;
    /// Index of the minimum along an axis (uint32).
    argmin => Argmin;
    /// log(sum(exp(x))) along an axis, computed stably.
    logsumexp => Logsumexp;
}

impl Array {
    /// The same elements under a new shape (one dimension may be -1).
    pub fn reshape(&self, shape: &[i32]) -> Result<Array> {
        Array::wrap("reshape", ffi::reshape(self.inner(), shape))
    }

    /// Permutes the axes.
    pub fn transpose(&self, axes: &[i32]) -> Result<Array> {
        Array::wrap("transpose", ffi::transpose(self.inner(), axes))
    }

    /// Inserts a dimension of size 1 at `axis`.
    pub fn expand_dims(&self, axis: i32) -> Result<Array> {
        Array::wrap("expand_dims", ffi::expand_dims(self.inner(), axis))
    }

    /// Removes the size-1 dimension at `axis`.
    pub fn squeeze(&self, axis: i32) -> Result<Array> {
        Array::wrap("squeeze", ffi::squeeze(self.inner(), axis))
    }

    /// Broadcasts to a larger shape without copying.
    pub fn broadcast_to(&self, shape: &[i32]) -> Result<Array> {
        Array::wrap("broadcast_to", ffi::broadcast_to(self.inner(), shape))
    }

    /// The sub-array `[start, stop)` along every axis, with unit strides.
    pub fn slice(&self, start: &[i32], stop: &[i32]) -> Result<Array> {
        let strides = vec![1; start.len()];
        self.slice_strided(start, stop, &strides)
    }

    /// The sub-array `[start, stop)` with the given strides along every axis.
    pub fn slice_strided(&self, start: &[i32], stop: &[i32], strides: &[i32]) -> Result<Array> {
        Array::wrap("slice", ffi::slice(self.inner(), start, stop, strides))
    }

    /// Writes `update` into `[start, stop)` of this array and returns the result.
    ///
    /// Takes `self` by value: when no other handle to this array exists, MLX reuses its
    /// buffer and the update happens in place; a live clone forces a copy.
    pub fn slice_update(self, update: &Array, start: &[i32], stop: &[i32]) -> Result<Array> {
        Array::wrap(
            "slice_update",
            ffi::slice_update(self.raw, update.inner(), start, stop),
        )
    }

    /// Writes `updates` at the positions `indices` pick along `axes` (one integer index
    /// array per axis, broadcast together; positions along other axes start at 0) and
    /// returns the result: `updates` has the indices' shape followed by one slice of this
    /// array (`self.shape()` with 1 on every indexed axis). Indices are clamped into range
    /// (MLX does not check them); negative ones write at 0. Takes `self` by value, so MLX
    /// can write in place as in [`Array::slice_update`].
    pub fn scatter(self, indices: &[&Array], updates: &Array, axes: &[i32]) -> Result<Array> {
        self.scatter_with(indices, updates, axes, true)
    }

    /// [`Array::scatter`] without clamping the indices: one op instead of one more per
    /// index array.
    ///
    /// # Safety
    /// Every index must lie in `0..self.shape()[axis]` of its axis: MLX does not check,
    /// and an index outside writes outside the array's buffer.
    pub unsafe fn scatter_unchecked(
        self,
        indices: &[&Array],
        updates: &Array,
        axes: &[i32],
    ) -> Result<Array> {
        self.scatter_with(indices, updates, axes, false)
    }

    fn scatter_with(
        self,
        indices: &[&Array],
        updates: &Array,
        axes: &[i32],
        clamp: bool,
    ) -> Result<Array> {
        if indices.len() != axes.len() {
            return Err(crate::Error::Mlx {
                op: "scatter",
                message: format!("{} index arrays for {} axes", indices.len(), axes.len()),
            });
        }
        let l = list("scatter", indices)?;
        Array::wrap(
            "scatter",
            ffi::scatter(self.raw, &l, updates.inner(), axes, clamp),
        )
    }

    /// Gathers entries at `indices` along `axis`.
    pub fn take(&self, indices: &Array, axis: i32) -> Result<Array> {
        Array::wrap("take", ffi::take(self.inner(), indices.inner(), axis))
    }

    /// Gathers along `axis` with an index array of the same rank.
    pub fn take_along_axis(&self, indices: &Array, axis: i32) -> Result<Array> {
        Array::wrap(
            "take_along_axis",
            ffi::take_along_axis(self.inner(), indices.inner(), axis),
        )
    }

    /// Converts the elements to another dtype.
    pub fn astype(&self, dtype: Dtype) -> Result<Array> {
        Array::wrap("astype", ffi::astype(self.inner(), dtype.code()))
    }

    /// A row-major contiguous copy (or the array itself when it already is one).
    pub fn contiguous(&self) -> Result<Array> {
        Array::wrap("contiguous", ffi::contiguous(self.inner()))
    }

    /// Matrix product over the last two axes (batched over the rest).
    pub fn matmul(&self, other: &Array) -> Result<Array> {
        Array::wrap("matmul", ffi::matmul(self.inner(), other.inner()))
    }

    /// Softmax along an axis; `precise` accumulates half types in f32.
    pub fn softmax(&self, axis: i32, precise: bool) -> Result<Array> {
        Array::wrap("softmax", ffi::softmax(self.inner(), axis, precise))
    }

    /// The `k` largest values along an axis (in no particular order).
    pub fn topk(&self, k: i32, axis: i32) -> Result<Array> {
        Array::wrap("topk", ffi::topk(self.inner(), k, axis))
    }

    /// Indices that sort along an axis (ascending, uint32).
    pub fn argsort(&self, axis: i32) -> Result<Array> {
        Array::wrap("argsort", ffi::argsort(self.inner(), axis))
    }

    /// Sorted values along an axis (ascending).
    pub fn sort(&self, axis: i32) -> Result<Array> {
        Array::wrap("sort", ffi::sort(self.inner(), axis))
    }

    /// Cumulative sum along an axis.
    pub fn cumsum(&self, axis: i32, reverse: bool, inclusive: bool) -> Result<Array> {
        Array::wrap(
            "cumsum",
            ffi::cumsum(self.inner(), axis, reverse, inclusive),
        )
    }

    /// Adds a scalar (in this array's dtype).
    pub fn add_scalar(&self, value: f64) -> Result<Array> {
        self.add(&Array::scalar(value, self.dtype())?)
    }

    /// Multiplies by a scalar (in this array's dtype).
    pub fn mul_scalar(&self, value: f64) -> Result<Array> {
        self.mul(&Array::scalar(value, self.dtype())?)
    }
}
