// Bulk copies between host memory and MLX's CUDA device buffers through the CUDA driver,
// bypassing MLX's unified-memory path (docs/mlx.md, "Host <-> device transfers on CUDA").
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "mlx/mlx.h"

namespace kvmlx::direct {

// Whether direct copies are possible in this process (a CUDA libmlx of the layout this file
// was written against, with libcuda loaded) and not switched off.
bool available();

// Switches direct copies on or off (on by default where available); returns the old value.
bool set_enabled(bool on);

// Copies the `n` bytes of an evaluated, row-contiguous array that lives in CUDA device
// memory to `out`. Returns false (and copies nothing) when the array is not in device memory
// or direct copies are unavailable; the caller then reads it the ordinary way.
bool read(const mlx::core::array& a, uint8_t* out, size_t n);

// A new device array of `shape`/`dtype` holding `n` host bytes, copied straight into device
// memory; std::nullopt when direct copies are unavailable (the caller builds it the ordinary
// way).
std::optional<mlx::core::array> upload(const uint8_t* data, size_t n, const mlx::core::Shape& shape,
                                       mlx::core::Dtype dtype);

// One array's part of write_rows: `height` rows of `width` bytes, consecutive at `src`,
// to go at a row pitch of `pitch` bytes from the start of `dst`'s data.
struct RowsWrite {
  const mlx::core::array* dst;
  const uint8_t* src;
  size_t width;
  size_t height;
  size_t pitch;
};

// Copies each write's rows into the buffer of its array (evaluated, row-contiguous): one
// driver copy each into device memory (queued together, then waited for), a host copy per
// row where MLX's allocator gave the array managed or page-locked memory. MLX does not see
// the writes, so each array must be owned by the caller alone with nothing queued on it (a
// zero array just evaluated). Returns false, copying nothing, where direct copies are
// unavailable or an array has no buffer; throws when rows do not fit.
bool write_rows(const std::vector<RowsWrite>& writes);

// Zero-filled arrays of `shapes`, each with a buffer of its own, evaluated before returning;
// on a GPU made on a stream of the calling thread's own, so the wait is not behind the
// default stream's queue.
std::vector<mlx::core::array> zeroed_off_queue(const std::vector<std::pair<mlx::core::Shape, mlx::core::Dtype>>& shapes);

// Page-locked host memory of `n` bytes (the driver DMAs to and from it without staging),
// or nullptr where direct copies are unavailable or the allocation fails.
uint8_t* pinned_alloc(size_t n);

// Frees what pinned_alloc returned.
void pinned_free(uint8_t* p);

}  // namespace kvmlx::direct
