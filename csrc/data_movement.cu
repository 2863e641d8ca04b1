// Data movement after acceptance: KV compaction of every layer in one launch, and the row gather /
// scatter of VVS's stale-feature cache.
//
// Indices are checked against the row counts: a row whose index is out of range is skipped and
// *error_flag (when given) is set to 1 on the device (vvs_engine/kernels/bounds.py reads it).
//
// Copies move whole rows in the widest unit (16/8/4/2/1 bytes) that the row size, the base pointers
// and the strides allow, so fp32/bf16/fp16 all get 16-byte loads for the usual head dims.
#include "vvs_kernels.h"

namespace {

// Shared-memory budget of one compaction block; the launcher splits the row into column chunks so
// that n_moves x chunk fits (the default 48 KiB limit needs no opt-in).
constexpr int64_t kStageBytes = 32 * 1024;
constexpr int kThreads = 256;

__device__ __forceinline__ bool in_range(int64_t i, int64_t n) { return i >= 0 && i < n; }

template <typename Unit>
__global__ void kv_compact_kernel(char* __restrict__ k, char* __restrict__ v, VvsKvStrides k_strides,
                                  VvsKvStrides v_strides, int64_t batch, int64_t heads, int64_t elem_size,
                                  int64_t row_units, int64_t chunk_units, const int64_t* __restrict__ src,
                                  const int64_t* __restrict__ dst, int64_t n, int64_t n_slots, int* error_flag) {
  extern __shared__ __align__(16) unsigned char stage_raw[];
  Unit* stage = reinterpret_cast<Unit*>(stage_raw);
  // blockIdx.x enumerates (buffer, layer, batch row, head); these tiles are disjoint memory, so the
  // only read-after-write hazard is inside a tile, which the stage-then-store order removes.
  int64_t tile = blockIdx.x;
  const int64_t h = tile % heads;
  tile /= heads;
  const int64_t b = tile % batch;
  tile /= batch;
  const int64_t n_layers_x2 = gridDim.x / (batch * heads);
  const int64_t layer = tile % (n_layers_x2 / 2);
  const bool is_v = tile >= n_layers_x2 / 2;
  const VvsKvStrides s = is_v ? v_strides : k_strides;
  char* base = (is_v ? v : k) + (layer * s.layer + b * s.batch + h * s.head) * elem_size;
  const int64_t slot_bytes = s.slot * elem_size;

  const int64_t col0 = blockIdx.y * chunk_units;
  const int64_t cols = (row_units - col0) < chunk_units ? (row_units - col0) : chunk_units;
  const int64_t total = n * cols;
  for (int64_t e = threadIdx.x; e < total; e += blockDim.x) {
    const int64_t r = e / cols;
    const int64_t c = e - r * cols;
    if (in_range(src[r], n_slots) && in_range(dst[r], n_slots)) {
      stage[e] = reinterpret_cast<const Unit*>(base + src[r] * slot_bytes)[col0 + c];
    } else if (c == 0 && error_flag != nullptr) {
      atomicOr(error_flag, 1);
    }
  }
  __syncthreads();  // every source read before any destination write
  for (int64_t e = threadIdx.x; e < total; e += blockDim.x) {
    const int64_t r = e / cols;
    const int64_t c = e - r * cols;
    if (in_range(src[r], n_slots) && in_range(dst[r], n_slots)) {
      reinterpret_cast<Unit*>(base + dst[r] * slot_bytes)[col0 + c] = stage[e];
    }
  }
}

template <typename Unit>
__global__ void copy_rows_kernel(const char* __restrict__ in, int64_t in_stride_b, int64_t in_stride_s,
                                 const int64_t* __restrict__ in_index, char* __restrict__ out,
                                 int64_t out_stride_b, int64_t out_stride_s, const int64_t* __restrict__ out_index,
                                 int64_t batch, int64_t n, int64_t row_units, int64_t in_rows, int64_t out_rows,
                                 int* error_flag) {
  const int64_t total = batch * n * row_units;
  for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < total; e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t c = e % row_units;
    const int64_t j = (e / row_units) % n;
    const int64_t b = e / (row_units * n);
    const int64_t in_row = in_index ? in_index[j] : j;
    const int64_t out_row = out_index ? out_index[j] : j;
    if (!in_range(in_row, in_rows) || !in_range(out_row, out_rows)) {
      if (c == 0 && b == 0 && error_flag != nullptr) atomicOr(error_flag, 1);
      continue;
    }
    const Unit* src = reinterpret_cast<const Unit*>(in + b * in_stride_b + in_row * in_stride_s);
    Unit* dst = reinterpret_cast<Unit*>(out + b * out_stride_b + out_row * out_stride_s);
    dst[c] = src[c];
  }
}

// Widest unit dividing every byte quantity (row size, strides, base addresses).
int64_t pick_unit(int64_t row_bytes, const int64_t* quantities, int count) {
  int64_t unit = 16;
  while (unit > 1) {
    bool ok = row_bytes % unit == 0;
    for (int i = 0; ok && i < count; ++i) ok = quantities[i] % unit == 0;
    if (ok) break;
    unit /= 2;
  }
  return unit;
}

template <typename Unit>
cudaError_t launch_kv_compact(void* k, void* v, VvsKvStrides ks, VvsKvStrides vs, int64_t n_layers, int64_t batch,
                              int64_t heads, int64_t head_dim, int64_t elem_size, const int64_t* src,
                              const int64_t* dst, int64_t n, int64_t n_slots, int* error_flag, cudaStream_t stream) {
  const int64_t row_units = head_dim * elem_size / (int64_t)sizeof(Unit);
  int64_t chunk = kStageBytes / (n * (int64_t)sizeof(Unit));
  if (chunk > row_units) chunk = row_units;
  if (chunk < 1) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(2 * n_layers * batch * heads), static_cast<unsigned>((row_units + chunk - 1) / chunk));
  const size_t smem = static_cast<size_t>(n * chunk * sizeof(Unit));
  kv_compact_kernel<Unit><<<grid, kThreads, smem, stream>>>(static_cast<char*>(k), static_cast<char*>(v), ks, vs,
                                                            batch, heads, elem_size, row_units, chunk, src, dst, n,
                                                            n_slots, error_flag);
  return cudaGetLastError();
}

template <typename Unit>
cudaError_t launch_copy_rows(const void* in, int64_t in_sb, int64_t in_ss, const int64_t* in_index, void* out,
                             int64_t out_sb, int64_t out_ss, const int64_t* out_index, int64_t batch, int64_t n,
                             int64_t row_bytes, int64_t in_rows, int64_t out_rows, int* error_flag,
                             cudaStream_t stream) {
  const int64_t row_units = row_bytes / (int64_t)sizeof(Unit);
  const int64_t total = batch * n * row_units;
  int64_t blocks = (total + kThreads - 1) / kThreads;
  if (blocks > 65535) blocks = 65535;  // grid-stride loop covers the rest
  copy_rows_kernel<Unit><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const char*>(in), in_sb, in_ss, in_index, static_cast<char*>(out), out_sb, out_ss, out_index,
      batch, n, row_units, in_rows, out_rows, error_flag);
  return cudaGetLastError();
}

}  // namespace

extern "C" cudaError_t vvs_kv_compact(void* k, void* v, VvsKvStrides k_strides, VvsKvStrides v_strides,
                                      int64_t n_layers, int64_t batch, int64_t heads, int64_t head_dim,
                                      int64_t elem_size, const int64_t* src, const int64_t* dst, int64_t n,
                                      int64_t n_slots, int* error_flag, cudaStream_t stream) {
  if (n <= 0 || n_layers <= 0 || batch <= 0 || heads <= 0 || head_dim <= 0) return cudaSuccess;
  if (n > 2048) return cudaErrorInvalidValue;
  const int64_t quantities[] = {
      (int64_t)(uintptr_t)k, (int64_t)(uintptr_t)v,
      k_strides.layer * elem_size, k_strides.batch * elem_size, k_strides.head * elem_size, k_strides.slot * elem_size,
      v_strides.layer * elem_size, v_strides.batch * elem_size, v_strides.head * elem_size, v_strides.slot * elem_size,
  };
  switch (pick_unit(head_dim * elem_size, quantities, 10)) {
    case 16: return launch_kv_compact<uint4>(k, v, k_strides, v_strides, n_layers, batch, heads, head_dim, elem_size, src, dst, n, n_slots, error_flag, stream);
    case 8: return launch_kv_compact<uint2>(k, v, k_strides, v_strides, n_layers, batch, heads, head_dim, elem_size, src, dst, n, n_slots, error_flag, stream);
    case 4: return launch_kv_compact<uint32_t>(k, v, k_strides, v_strides, n_layers, batch, heads, head_dim, elem_size, src, dst, n, n_slots, error_flag, stream);
    case 2: return launch_kv_compact<uint16_t>(k, v, k_strides, v_strides, n_layers, batch, heads, head_dim, elem_size, src, dst, n, n_slots, error_flag, stream);
    default: return launch_kv_compact<uint8_t>(k, v, k_strides, v_strides, n_layers, batch, heads, head_dim, elem_size, src, dst, n, n_slots, error_flag, stream);
  }
}

extern "C" cudaError_t vvs_copy_rows(const void* in, int64_t in_stride_b, int64_t in_stride_s, const int64_t* in_index,
                                     void* out, int64_t out_stride_b, int64_t out_stride_s, const int64_t* out_index,
                                     int64_t batch, int64_t n, int64_t dim, int64_t elem_size, int64_t in_rows,
                                     int64_t out_rows, int* error_flag, cudaStream_t stream) {
  if (batch <= 0 || n <= 0 || dim <= 0) return cudaSuccess;
  // From here on strides are in bytes.
  in_stride_b *= elem_size;
  in_stride_s *= elem_size;
  out_stride_b *= elem_size;
  out_stride_s *= elem_size;
  const int64_t quantities[] = {(int64_t)(uintptr_t)in, (int64_t)(uintptr_t)out, in_stride_b, in_stride_s,
                                out_stride_b, out_stride_s};
  const int64_t row_bytes = dim * elem_size;
  switch (pick_unit(row_bytes, quantities, 6)) {
    case 16: return launch_copy_rows<uint4>(in, in_stride_b, in_stride_s, in_index, out, out_stride_b, out_stride_s, out_index, batch, n, row_bytes, in_rows, out_rows, error_flag, stream);
    case 8: return launch_copy_rows<uint2>(in, in_stride_b, in_stride_s, in_index, out, out_stride_b, out_stride_s, out_index, batch, n, row_bytes, in_rows, out_rows, error_flag, stream);
    case 4: return launch_copy_rows<uint32_t>(in, in_stride_b, in_stride_s, in_index, out, out_stride_b, out_stride_s, out_index, batch, n, row_bytes, in_rows, out_rows, error_flag, stream);
    case 2: return launch_copy_rows<uint16_t>(in, in_stride_b, in_stride_s, in_index, out, out_stride_b, out_stride_s, out_index, batch, n, row_bytes, in_rows, out_rows, error_flag, stream);
    default: return launch_copy_rows<uint8_t>(in, in_stride_b, in_stride_s, in_index, out, out_stride_b, out_stride_s, out_index, batch, n, row_bytes, in_rows, out_rows, error_flag, stream);
  }
}
