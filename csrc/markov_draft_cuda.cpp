// Torch glue of the CUDA implementation of vllm_dspark::markov_draft: checks
// the arguments, allocates the kernels' scratch, takes the current stream and
// calls the raw-pointer launcher in markov_draft_kernels.cu. Built only with a
// CUDA torch (setup.py); the kernels themselves compile without torch
// (scripts/compile_cuda.sh) and run on the CPU in the SIMT harness
// (scripts/emulate_cuda.py).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "markov_draft_args.h"
#include "markov_draft_kernels.h"

namespace dspark {
namespace {

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    default: TORCH_CHECK(false, "markov_draft: unsupported dtype ", t);
  }
}

void markov_draft_cuda(const at::Tensor& base_logits, const at::Tensor& anchor_ids,
                       const at::Tensor& markov_w1, const at::Tensor& markov_w2,
                       const at::Tensor& w2_row_norms,
                       const std::optional<at::Tensor>& conf_base,
                       const std::optional<at::Tensor>& conf_w_markov,
                       const at::Tensor& temperature, const at::Tensor& seeds,
                       const at::Tensor& out_tokens, const at::Tensor& out_conf,
                       const std::optional<at::Tensor>& out_logits,
                       const std::optional<at::Tensor>& out_stats,
                       const std::optional<at::Tensor>& max_norms,
                       const std::optional<at::Tensor>& d2t,
                       const std::optional<at::Tensor>& head_hidden,
                       const std::optional<at::Tensor>& head_w, int64_t head_type) {
  // check_markov_args also puts every optional tensor on base_logits' device,
  // so a host conf_base / conf_w_markov / out_logits / out_stats / max_norms
  // is rejected here with its name instead of being dereferenced by a kernel.
  const MarkovShapes sh = check_markov_args(
      base_logits, anchor_ids, markov_w1, markov_w2, w2_row_norms, conf_base, conf_w_markov,
      temperature, seeds, out_tokens, out_conf, out_logits, out_stats, max_norms, d2t,
      head_hidden, head_w, head_type);
  TORCH_CHECK(base_logits.is_cuda(), "markov_draft: CUDA kernel called with CPU tensors");
  TORCH_CHECK(sh.num_reqs < (int64_t(1) << 24), "markov_draft: at most 2^24 requests per call");
  const c10::cuda::OptionalCUDAGuard guard(base_logits.device());
  // No-ops for the contiguous tensors the wrapper passes. Anchor ids are not
  // range-checked (that would synchronise): an out-of-range anchor means "no
  // Markov embedding", in the kernels as in the reference.
  const at::Tensor base = base_logits.contiguous();
  const at::Tensor anchor = anchor_ids.contiguous();
  const at::Tensor w1 = markov_w1.contiguous();
  const at::Tensor w2 = markov_w2.contiguous();
  const at::Tensor norms = w2_row_norms.contiguous();
  const at::Tensor temp = temperature.contiguous();
  const at::Tensor sd = seeds.contiguous();
  at::Tensor cb, cw, mn, dt, hh, hw;
  if (conf_base.has_value()) cb = conf_base->contiguous();
  if (head_hidden.has_value()) hh = head_hidden->contiguous();
  if (head_w.has_value()) hw = head_w->contiguous();
  if (conf_w_markov.has_value()) cw = conf_w_markov->contiguous();
  if (max_norms.has_value()) mn = max_norms->contiguous();
  if (d2t.has_value()) dt = d2t->contiguous();

  MarkovDraftParams p{};
  p.base = base.data_ptr();
  p.base_dtype = to_dtype(base.scalar_type());
  p.anchor = anchor.data_ptr<int64_t>();
  p.w1 = w1.data_ptr();
  p.w2 = w2.data_ptr();
  p.w_dtype = to_dtype(w2.scalar_type());
  p.norms = norms.data_ptr<float>();
  p.max_norms = mn.defined() ? mn.data_ptr<float>() : nullptr;
  p.conf_base = cb.defined() ? cb.data_ptr<float>() : nullptr;
  p.conf_w = cw.defined() ? cw.data_ptr<float>() : nullptr;
  p.temperature = temp.data_ptr<float>();
  p.seeds = sd.data_ptr<int64_t>();
  p.out_tokens = out_tokens.data_ptr<int64_t>();
  p.out_conf = out_conf.data_ptr<float>();
  p.out_logits = out_logits.has_value() ? out_logits->data_ptr<float>() : nullptr;
  p.out_stats = out_stats.has_value() ? out_stats->data_ptr<int32_t>() : nullptr;
  p.d2t = dt.defined() ? dt.data_ptr<int64_t>() : nullptr;
  p.head_hidden = hh.defined() ? hh.data_ptr<float>() : nullptr;
  p.head_w = hw.defined() ? hw.data_ptr<float>() : nullptr;
  p.head_type = static_cast<int>(head_type);
  p.V1 = sh.w1_rows;
  p.R = sh.num_reqs;
  p.B = sh.block;
  p.V = sh.vocab;
  p.rank = sh.rank;
  if (p.R == 0 || p.B == 0) return;
  // Scratch from the caching allocator (stream-ordered, no host sync; during
  // CUDA-graph capture it comes from the graph's private pool). Its contents on
  // entry do not matter: the first kernel initialises what the second reads.
  const size_t ws_bytes = markov_workspace_bytes(p);
  const at::Tensor workspace = at::empty({static_cast<int64_t>(ws_bytes) + 256},
                                         base_logits.options().dtype(at::kByte));
  void* ws = reinterpret_cast<void*>(
      (reinterpret_cast<uintptr_t>(workspace.data_ptr()) + 255) / 256 * 256);
  const cudaError_t err =
      launch_markov_draft(p, ws, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "markov_draft: CUDA launch failed: ", cudaGetErrorString(err));
}

}  // namespace
}  // namespace dspark

TORCH_LIBRARY_IMPL(vllm_dspark, CUDA, m) { m.impl("markov_draft", &dspark::markov_draft_cuda); }
