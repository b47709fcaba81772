// Argument validation shared by the CPU and the CUDA torch glue of
// vllm_dspark::markov_draft (torch headers: never included by a .cu file).
#pragma once

#include <optional>

#include <ATen/ATen.h>

namespace dspark {

struct MarkovShapes {
  int64_t num_reqs;  // R
  int64_t block;     // B
  int64_t vocab;     // V: the scored (draft) vocabulary, rows of markov_w2
  int64_t w1_rows;   // rows of markov_w1 (== V without d2t; the target vocabulary with it)
  int64_t rank;      // r
};

inline MarkovShapes check_markov_args(
    const at::Tensor& base_logits, const at::Tensor& anchor_ids,
    const at::Tensor& markov_w1, const at::Tensor& markov_w2,
    const at::Tensor& w2_row_norms, const std::optional<at::Tensor>& conf_base,
    const std::optional<at::Tensor>& conf_w_markov, const at::Tensor& temperature,
    const at::Tensor& seeds, const at::Tensor& out_tokens, const at::Tensor& out_conf,
    const std::optional<at::Tensor>& out_logits,
    const std::optional<at::Tensor>& out_stats, const std::optional<at::Tensor>& max_norms,
    const std::optional<at::Tensor>& d2t, const std::optional<at::Tensor>& head_hidden,
    const std::optional<at::Tensor>& head_w, int64_t head_type) {
  TORCH_CHECK(base_logits.dim() == 3, "markov_draft: base_logits must be [R, B, V], got ",
              base_logits.sizes());
  const int64_t R = base_logits.size(0), B = base_logits.size(1), V = base_logits.size(2);
  // Without d2t the previous token is a row of markov_w1 as drafted, so both
  // weights span the one vocabulary. With it markov_w1 is indexed by target ids
  // and may have any number of rows; only the rank must agree.
  if (d2t.has_value()) {
    TORCH_CHECK(markov_w1.dim() == 2 && markov_w2.dim() == 2 &&
                    markov_w1.size(1) == markov_w2.size(1) && markov_w1.size(0) >= 1,
                "markov_draft: with d2t, markov_w1 must be [V_target, rank] and markov_w2 "
                "[V_draft, rank], got ", markov_w1.sizes(), " and ", markov_w2.sizes());
  } else {
    TORCH_CHECK(markov_w1.dim() == 2 && markov_w2.dim() == 2 &&
                    markov_w1.sizes() == markov_w2.sizes(),
                "markov_draft: markov_w1 and markov_w2 must both be [V, rank], got ",
                markov_w1.sizes(), " and ", markov_w2.sizes(),
                " (a draft vocabulary needs d2t)");
  }
  TORCH_CHECK(markov_w2.size(0) == V, "markov_draft: markov_w2 has ", markov_w2.size(0),
              " rows but base_logits has vocab ", V);
  TORCH_CHECK(V < (int64_t(1) << 31), "markov_draft: vocab must be < 2^31");
  const int64_t rank = markov_w2.size(1);
  TORCH_CHECK(rank >= 1, "markov_draft: rank must be >= 1");
  TORCH_CHECK(markov_w1.scalar_type() == markov_w2.scalar_type(),
              "markov_draft: markov_w1 and markov_w2 must share a dtype");
  auto float_like = [](at::ScalarType t) {
    return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
  };
  TORCH_CHECK(float_like(base_logits.scalar_type()) && float_like(markov_w2.scalar_type()),
              "markov_draft: base_logits and Markov weights must be fp32, bf16 or fp16");
  auto check_1d = [&](const at::Tensor& t, int64_t n, at::ScalarType dt, const char* name) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == n && t.scalar_type() == dt,
                "markov_draft: ", name, " must be [", n, "] of ", dt, ", got ", t.sizes(),
                " of ", t.scalar_type());
  };
  auto check_2d = [&](const at::Tensor& t, int64_t n, int64_t m, at::ScalarType dt,
                      const char* name) {
    TORCH_CHECK(t.dim() == 2 && t.size(0) == n && t.size(1) == m && t.scalar_type() == dt,
                "markov_draft: ", name, " must be [", n, ", ", m, "] of ", dt, ", got ",
                t.sizes(), " of ", t.scalar_type());
  };
  check_1d(anchor_ids, R, at::kLong, "anchor_ids");
  check_1d(w2_row_norms, V, at::kFloat, "w2_row_norms");
  check_1d(temperature, R, at::kFloat, "temperature");
  check_1d(seeds, R, at::kLong, "seeds");
  if (conf_base.has_value()) check_2d(*conf_base, R, B, at::kFloat, "conf_base");
  if (conf_w_markov.has_value()) check_1d(*conf_w_markov, rank, at::kFloat, "conf_w_markov");
  check_2d(out_tokens, R, B, at::kLong, "out_tokens");
  check_2d(out_conf, R, B, at::kFloat, "out_conf");
  if (out_stats.has_value()) check_2d(*out_stats, R, B, at::kInt, "out_stats");
  if (out_logits.has_value()) {
    const auto& l = *out_logits;
    TORCH_CHECK(l.dim() == 3 && l.size(0) == R && l.size(1) == B && l.size(2) == V &&
                    l.scalar_type() == at::kFloat,
                "markov_draft: out_logits must be [R, B, V] fp32, got ", l.sizes(), " of ",
                l.scalar_type());
  }
  for (const at::Tensor* t : {&out_tokens, &out_conf}) {
    TORCH_CHECK(t->is_contiguous(), "markov_draft: outputs must be contiguous");
  }
  if (out_logits.has_value()) TORCH_CHECK(out_logits->is_contiguous(), "markov_draft: out_logits must be contiguous");
  if (out_stats.has_value()) TORCH_CHECK(out_stats->is_contiguous(), "markov_draft: out_stats must be contiguous");
  if (max_norms.has_value()) check_1d(*max_norms, 2, at::kFloat, "max_norms");
  // d2t's values (target ids inside markov_w1) are not checked here: that would
  // synchronise with a device. The wrapper and the loaders check them once; a
  // mapped id outside markov_w1 gets no Markov embedding, like a bad anchor.
  if (d2t.has_value()) check_1d(*d2t, V, at::kLong, "d2t");
  // The head variant (markov_common.h: kHeadVanilla / kHeadGated / kHeadRnn).
  TORCH_CHECK(head_type >= 0 && head_type <= 2, "markov_draft: head_type must be 0 (vanilla), "
              "1 (gated) or 2 (rnn), got ", head_type);
  if (head_type == 0) {
    TORCH_CHECK(!head_hidden.has_value() && !head_w.has_value(),
                "markov_draft: head_hidden/head_w given but head_type is 0 (vanilla)");
  } else {
    const char* name = head_type == 1 ? "gated" : "rnn";
    const int64_t m = head_type == 1 ? rank : 3 * rank;
    const int64_t in = head_type == 1 ? rank : 2 * rank;
    TORCH_CHECK(head_hidden.has_value(), "markov_draft: the ", name, " head needs head_hidden [",
                R, ", ", B, ", ", m, "] fp32");
    TORCH_CHECK(head_w.has_value(), "markov_draft: the ", name, " head needs head_w [", m, ", ", in,
                "] fp32");
    const auto& hh = *head_hidden;
    TORCH_CHECK(hh.dim() == 3 && hh.size(0) == R && hh.size(1) == B && hh.size(2) == m &&
                    hh.scalar_type() == at::kFloat,
                "markov_draft: head_hidden must be [", R, ", ", B, ", ", m, "] fp32 for the ", name,
                " head, got ", hh.sizes(), " of ", hh.scalar_type());
    check_2d(*head_w, m, in, at::kFloat, "head_w");
  }
  // Every tensor, optional ones included, must live on base_logits' device:
  // a host tensor handed to the CUDA op would otherwise be dereferenced by a
  // kernel.
  const auto dev = base_logits.device();
  auto same_device = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.device() == dev, "markov_draft: ", name, " is on ", t.device(),
                " but base_logits is on ", dev, "; all tensors must be on one device");
  };
  same_device(anchor_ids, "anchor_ids");
  same_device(markov_w1, "markov_w1");
  same_device(markov_w2, "markov_w2");
  same_device(w2_row_norms, "w2_row_norms");
  same_device(temperature, "temperature");
  same_device(seeds, "seeds");
  same_device(out_tokens, "out_tokens");
  same_device(out_conf, "out_conf");
  if (conf_base.has_value()) same_device(*conf_base, "conf_base");
  if (conf_w_markov.has_value()) same_device(*conf_w_markov, "conf_w_markov");
  if (out_logits.has_value()) same_device(*out_logits, "out_logits");
  if (out_stats.has_value()) same_device(*out_stats, "out_stats");
  if (max_norms.has_value()) same_device(*max_norms, "max_norms");
  if (d2t.has_value()) same_device(*d2t, "d2t");
  if (head_hidden.has_value()) same_device(*head_hidden, "head_hidden");
  if (head_w.has_value()) same_device(*head_w, "head_w");
  return {R, B, V, markov_w1.size(0), rank};
}

}  // namespace dspark
