// The one declaration of vllm_dspark's ops. Implementations register against
// these schemas by dispatch key: CPU in markov_draft_cpu.cpp, CUDA in
// markov_draft_cuda.cpp (built only with a CUDA torch); row_argmax has a CPU
// implementation only (row_argmax_cpu.cpp). The fake (meta)
// implementation is registered from Python in vllm_dspark/ops/markov.py.
#include <Python.h>

#include <torch/library.h>

TORCH_LIBRARY(vllm_dspark, m) {
  // Sequential Markov bias + token pick + confidence for one draft block. See
  // vllm_dspark/ops/markov.py for the contract and
  // vllm_dspark/ops/markov_reference.py for the golden semantics. How many of
  // the drafts are verified is not the op's: the serving paths decide it from
  // the confidences (vllm_dspark/spec_decode/common/verify.py, the budget).
  //   base_logits   [R, B, V] fp32/bf16/fp16 (V: the draft vocabulary when d2t is given)
  //   anchor_ids    [R] int64, a row of markov_w1 (a target id)
  //   markov_w1/w2  [V, rank] (same dtype, fp32/bf16/fp16); with d2t markov_w1 is
  //                 [V_target, rank], indexed by target ids
  //   w2_row_norms  [V] fp32 (markov_row_norms(markov_w2))
  //   conf_base     [R, B] fp32 or None (no confidence head: confidences are 1)
  //   conf_w_markov [rank] fp32 or None
  //   temperature   [R] fp32 (<= 0: greedy), seeds [R] int64
  //   out_tokens [R, B] int64, out_conf [R, B] fp32
  //   out_logits [R, B, V] fp32 or None (given: dense path, corrected logits)
  //   out_stats  [R, B] int32 or None (exact scores evaluated per row; V = dense)
  //   max_norms  [2] fp32 or None: markov_max_norms(markov_w1, w2_row_norms),
  //              the prev-independent bound the CUDA kernel needs (recomputed
  //              per call when None; the CPU twin does not use it).
  //   d2t        [V] int64 or None: draft-vocabulary offsets (target id = draft id
  //              + d2t[draft id]). Tokens, logits and stats stay in draft ids; only
  //              the previous token's markov_w1 row is its target id. Appended last
  //              so that positional callers of the older schema keep working.
  //   head_hidden [R, B, m] fp32 or None, head_w fp32 or None, head_type int (0 vanilla,
  //              1 gated: m = rank, head_w [rank, rank]; 2 rnn: m = 3 rank, head_w
  //              [3 rank, 2 rank]): the Markov head variant. head_hidden is the part
  //              that reads the backbone's hidden rows (precomputed by the caller for
  //              every position, bias included), head_w the token side; the op computes
  //              v from e (and the rnn state) and adds markov_w2 @ v. Appended after d2t
  //              for the same reason; the default is the vanilla head.
  m.def(
      "markov_draft(Tensor base_logits, Tensor anchor_ids, Tensor markov_w1, "
      "Tensor markov_w2, Tensor w2_row_norms, Tensor? conf_base, Tensor? conf_w_markov, "
      "Tensor temperature, Tensor seeds, Tensor(a!) out_tokens, Tensor(b!) out_conf, "
      "Tensor(c!)? out_logits, Tensor(d!)? out_stats, Tensor? max_norms=None, "
      "Tensor? d2t=None, Tensor? head_hidden=None, Tensor? head_w=None, "
      "int head_type=0) -> ()");
  // argmax over the last dimension of x[rows] (all rows when None), as torch.argmax gives it.
  // CPU only (row_argmax_cpu.cpp): torch's CPU argmax does not vectorise; on other devices the
  // callers keep torch's. Used by the greedy verify shortcut of the rejection-sampler patch.
  //   x [N, V] fp32/bf16/fp16, rows [R] int32/int64 or None -> [R] int64
  m.def("row_argmax(Tensor x, Tensor? rows=None) -> Tensor");
}

// Importing vllm_dspark._C runs the static registrations above; the module
// itself has no Python attributes.
static struct PyModuleDef dspark_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&dspark_module); }
