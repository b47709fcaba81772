// Harness executable: runs dspark::launch_markov_draft (the real kernels of
// csrc/markov_draft_kernels.cu, compiled as host C++ with DSPARK_SIMT) on
// inputs written by scripts/emulate_cuda.py, writes the outputs and prints the
// per-launch counters as JSON on stdout.
//
// Usage: simt_markov DIR   (DIR/meta.txt: "key value" lines; DIR/<name>.bin:
// raw little-endian arrays; outputs are written to DIR/out_<name>.bin).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "markov_draft_kernels.h"

namespace simt {
void register_buffer(const void* p, size_t bytes, const char* name);
void write_launch_stats(FILE* out);
}  // namespace simt

namespace {

std::string g_dir;

std::vector<unsigned char>* load(const char* name, size_t bytes, bool required) {
  const std::string path = g_dir + "/" + name + ".bin";
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    if (required) {
      std::fprintf(stderr, "missing %s\n", path.c_str());
      std::exit(2);
    }
    return nullptr;
  }
  auto* v = new std::vector<unsigned char>(bytes);
  if (bytes > 0 && std::fread(v->data(), 1, bytes, f) != bytes) {
    std::fprintf(stderr, "short file %s (want %zu bytes)\n", path.c_str(), bytes);
    std::exit(2);
  }
  std::fclose(f);
  simt::register_buffer(v->data(), bytes, name);
  return v;
}

std::vector<unsigned char>* output(const char* name, size_t bytes) {
  auto* v = new std::vector<unsigned char>(bytes, 0xA5);  // garbage: outputs are not pre-zeroed
  simt::register_buffer(v->data(), bytes, name);
  return v;
}

void save(const char* name, const std::vector<unsigned char>* v) {
  if (v == nullptr) return;
  const std::string path = g_dir + "/out_" + name + ".bin";
  FILE* f = std::fopen(path.c_str(), "wb");
  std::fwrite(v->data(), 1, v->size(), f);
  std::fclose(f);
}

size_t dsize(int dt) { return dt == 0 ? 4 : 2; }

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  g_dir = argv[1];
  std::map<std::string, double> meta;
  {
    FILE* f = std::fopen((g_dir + "/meta.txt").c_str(), "r");
    if (f == nullptr) return 2;
    char key[64];
    double val;
    while (std::fscanf(f, "%63s %lf", key, &val) == 2) meta[key] = val;
    std::fclose(f);
  }
  const int64_t R = static_cast<int64_t>(meta["R"]), B = static_cast<int64_t>(meta["B"]);
  const int64_t V = static_cast<int64_t>(meta["V"]), rank = static_cast<int64_t>(meta["rank"]);
  const int bdt = static_cast<int>(meta["base_dtype"]), wdt = static_cast<int>(meta["w_dtype"]);
  // Rows of w1: the target vocabulary with a draft vocabulary (d2t.bin), else V.
  const int64_t V1 = meta.count("V1") ? static_cast<int64_t>(meta["V1"]) : V;

  dspark::MarkovDraftParams p{};
  p.R = R;
  p.B = B;
  p.V = V;
  p.rank = rank;
  p.V1 = V1;
  p.base_dtype = static_cast<dspark::DType>(bdt);
  p.w_dtype = static_cast<dspark::DType>(wdt);
  auto* base = load("base", R * B * V * dsize(bdt), true);
  auto* anchor = load("anchor", R * 8, true);
  auto* w1 = load("w1", V1 * rank * dsize(wdt), true);
  auto* w2 = load("w2", V * rank * dsize(wdt), true);
  auto* norms = load("norms", V * 4, true);
  auto* max_norms = load("max_norms", 8, false);
  auto* d2t = load("d2t", V * 8, false);
  // Head variants: head_type 1 (gated, head_hidden [R, B, rank], head_w [rank, rank]) or 2 (rnn,
  // [R, B, 3 rank] and [3 rank, 2 rank]).
  const int head_type = meta.count("head_type") ? static_cast<int>(meta["head_type"]) : 0;
  const int64_t hm = head_type == 2 ? 3 * rank : rank, hin = head_type == 2 ? 2 * rank : rank;
  auto* head_hidden = head_type != 0 ? load("head_hidden", R * B * hm * 4, true) : nullptr;
  auto* head_w = head_type != 0 ? load("head_w", hm * hin * 4, true) : nullptr;
  auto* conf_base = load("conf_base", R * B * 4, false);
  auto* conf_w = load("conf_w", rank * 4, false);
  auto* temperature = load("temperature", R * 4, true);
  auto* seeds = load("seeds", R * 8, true);
  auto* tokens = output("tokens", R * B * 8);
  auto* conf = output("conf", R * B * 4);
  auto* logits = meta["logits"] != 0 ? output("logits", R * B * V * 4) : nullptr;
  auto* stats = meta["stats"] != 0 ? output("stats", R * B * 4) : nullptr;
  p.base = base->data();
  p.anchor = reinterpret_cast<const int64_t*>(anchor->data());
  p.w1 = w1->data();
  p.w2 = w2->data();
  p.norms = reinterpret_cast<const float*>(norms->data());
  p.max_norms = max_norms ? reinterpret_cast<const float*>(max_norms->data()) : nullptr;
  p.d2t = d2t ? reinterpret_cast<const int64_t*>(d2t->data()) : nullptr;
  p.head_type = head_type;
  p.head_hidden = head_hidden ? reinterpret_cast<const float*>(head_hidden->data()) : nullptr;
  p.head_w = head_w ? reinterpret_cast<const float*>(head_w->data()) : nullptr;
  p.conf_base = conf_base ? reinterpret_cast<const float*>(conf_base->data()) : nullptr;
  p.conf_w = conf_w ? reinterpret_cast<const float*>(conf_w->data()) : nullptr;
  p.temperature = reinterpret_cast<const float*>(temperature->data());
  p.seeds = reinterpret_cast<const int64_t*>(seeds->data());
  p.out_tokens = reinterpret_cast<int64_t*>(tokens->data());
  p.out_conf = reinterpret_cast<float*>(conf->data());
  p.out_logits = logits ? reinterpret_cast<float*>(logits->data()) : nullptr;
  p.out_stats = stats ? reinterpret_cast<int32_t*>(stats->data()) : nullptr;

  const size_t ws_bytes = dspark::markov_workspace_bytes(p);
  std::vector<unsigned char> ws(ws_bytes + 256, 0x5A);  // garbage on entry, as from the allocator
  unsigned char* ws_aligned = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(ws.data()) + 255) / 256 * 256);
  simt::register_buffer(ws_aligned, ws_bytes, "workspace");
  const cudaError_t err = dspark::launch_markov_draft(p, ws_aligned, nullptr);
  if (err != cudaSuccess) {
    std::fprintf(stderr, "launch_markov_draft returned %d\n", err);
    return 4;
  }
  save("tokens", tokens);
  save("conf", conf);
  save("logits", logits);
  save("stats", stats);
  std::printf("{\"workspace_bytes\": %zu, \"launches\": ", ws_bytes);
  simt::write_launch_stats(stdout);
  std::printf("}\n");
  return 0;
}
