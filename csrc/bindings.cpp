// torch / pybind11 binding of the CUDA launchers in vvs_kernels.h, built as vvs_engine._C by setup.py
// or CMakeLists.txt where a CUDA build of torch exists. Python registers these functions as the cuda
// backend of the vvs:: custom ops (vvs_engine/kernels/ops.py), so no op schema is declared here.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <optional>
#include <tuple>

#include "vvs_kernels.h"

namespace {

void check_cuda_int64(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == at::kLong, name, " must be int64");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, " launch failed: ", cudaGetErrorString(err));
}

// The device bounds flag (int32 [1], vvs_engine/kernels/bounds.py), or null when not given.
int* flag_ptr(const std::optional<at::Tensor>& flag) {
  if (!flag.has_value()) return nullptr;
  TORCH_CHECK(flag->is_cuda() && flag->scalar_type() == at::kInt && flag->numel() == 1, "error_flag must be a CUDA int32 [1]");
  return flag->data_ptr<int>();
}

VvsKvStrides kv_strides(const at::Tensor& t) {
  return VvsKvStrides{t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> tree_meta(const at::Tensor& parents, int64_t max_depth) {
  check_cuda_int64(parents, "parents");
  TORCH_CHECK(parents.dim() == 1, "parents must be [N]");
  TORCH_CHECK(max_depth >= 0, "max_depth must be >= 0");
  const c10::cuda::CUDAGuard guard(parents.device());
  const int64_t n = parents.size(0);
  auto as_bool = parents.options().dtype(at::kBool);
  at::Tensor mask = at::empty({n, n}, as_bool);
  at::Tensor depth = at::empty({n}, parents.options());
  at::Tensor paths = at::empty({n, max_depth + 1}, parents.options());
  at::Tensor is_leaf = at::empty({n}, as_bool);
  check_launch(vvs_tree_meta(parents.data_ptr<int64_t>(), n, max_depth, mask.data_ptr<bool>(),
                             depth.data_ptr<int64_t>(), paths.data_ptr<int64_t>(), is_leaf.data_ptr<bool>(),
                             c10::cuda::getCurrentCUDAStream().stream()),
               "tree_meta");
  return {mask, depth, paths, is_leaf};
}

void kv_compact(at::Tensor k, at::Tensor v, const at::Tensor& src, const at::Tensor& dst,
                const std::optional<at::Tensor>& error_flag) {
  TORCH_CHECK(k.is_cuda() && v.is_cuda(), "k and v must be CUDA tensors");
  TORCH_CHECK(k.dim() == 5 && k.sizes() == v.sizes(), "k and v must both be [L, B, H, S, D]");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "k and v must share a dtype");
  TORCH_CHECK(k.stride(4) == 1 && v.stride(4) == 1, "the head dim of k and v must be contiguous");
  check_cuda_int64(src, "src");
  check_cuda_int64(dst, "dst");
  TORCH_CHECK(src.dim() == 1 && src.sizes() == dst.sizes(), "src and dst must both be [n]");
  const c10::cuda::CUDAGuard guard(k.device());
  check_launch(vvs_kv_compact(k.data_ptr(), v.data_ptr(), kv_strides(k), kv_strides(v), k.size(0), k.size(1),
                              k.size(2), k.size(4), k.element_size(), src.data_ptr<int64_t>(),
                              dst.data_ptr<int64_t>(), src.size(0), k.size(3), flag_ptr(error_flag),
                              c10::cuda::getCurrentCUDAStream().stream()),
               "kv_compact");
}

at::Tensor gather_rows(const at::Tensor& x, const at::Tensor& idx, const std::optional<at::Tensor>& error_flag) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 3 && x.stride(2) == 1, "x must be a CUDA [B, S, D] tensor with contiguous D");
  check_cuda_int64(idx, "idx");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({x.size(0), idx.size(0), x.size(2)}, x.options());
  check_launch(vvs_copy_rows(x.data_ptr(), x.stride(0), x.stride(1), idx.data_ptr<int64_t>(), out.data_ptr(),
                             out.stride(0), out.stride(1), nullptr, x.size(0), idx.size(0), x.size(2),
                             x.element_size(), x.size(1), idx.size(0), flag_ptr(error_flag),
                             c10::cuda::getCurrentCUDAStream().stream()),
               "gather_rows");
  return out;
}

void scatter_rows_(at::Tensor x, const at::Tensor& idx, const at::Tensor& src,
                   const std::optional<at::Tensor>& error_flag) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 3 && x.stride(2) == 1, "x must be a CUDA [B, S, D] tensor with contiguous D");
  check_cuda_int64(idx, "idx");
  TORCH_CHECK(src.dim() == 3 && src.size(0) == x.size(0) && src.size(1) == idx.size(0) && src.size(2) == x.size(2),
              "src must be [B, n, D]");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor s = src.to(x.scalar_type()).contiguous();
  check_launch(vvs_copy_rows(s.data_ptr(), s.stride(0), s.stride(1), nullptr, x.data_ptr(), x.stride(0), x.stride(1),
                             idx.data_ptr<int64_t>(), x.size(0), idx.size(0), x.size(2), x.element_size(),
                             idx.size(0), x.size(1), flag_ptr(error_flag), c10::cuda::getCurrentCUDAStream().stream()),
               "scatter_rows_");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> accept_walk(const at::Tensor& accepted, const at::Tensor& first_child,
                                                           const at::Tensor& next_sibling, int64_t max_depth) {
  TORCH_CHECK(accepted.is_cuda() && accepted.dim() == 1, "accepted must be a CUDA [N] tensor");
  check_cuda_int64(first_child, "first_child");
  check_cuda_int64(next_sibling, "next_sibling");
  TORCH_CHECK(max_depth >= 0, "max_depth must be >= 0");
  const c10::cuda::CUDAGuard guard(accepted.device());
  at::Tensor acc = accepted.to(at::kBool).contiguous();
  at::Tensor path = at::empty({max_depth + 1}, first_child.options());
  at::Tensor n_accepted = at::empty({1}, first_child.options());
  at::Tensor last = at::empty({1}, first_child.options());
  check_launch(vvs_accept_walk(acc.data_ptr<bool>(), first_child.data_ptr<int64_t>(), next_sibling.data_ptr<int64_t>(),
                               acc.size(0), max_depth, path.data_ptr<int64_t>(), n_accepted.data_ptr<int64_t>(),
                               last.data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream().stream()),
               "accept_walk");
  return {path, n_accepted, last};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "vvs_engine CUDA kernels (tree metadata, KV compaction, row gather/scatter, acceptance walk)";
  m.def("tree_meta", &tree_meta, "tree metadata from parent indices");
  m.def("kv_compact", &kv_compact, "in-place overlap-safe KV compaction of every layer", py::arg("k"), py::arg("v"),
        py::arg("src"), py::arg("dst"), py::arg("error_flag") = py::none());
  m.def("gather_rows", &gather_rows, "x[:, idx] for x [B, S, D]", py::arg("x"), py::arg("idx"),
        py::arg("error_flag") = py::none());
  m.def("scatter_rows_", &scatter_rows_, "x[:, idx] = src in place", py::arg("x"), py::arg("idx"), py::arg("src"),
        py::arg("error_flag") = py::none());
  m.def("accept_walk", &accept_walk, "tree acceptance walk");
}
