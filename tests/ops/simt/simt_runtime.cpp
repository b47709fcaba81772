// Host runtime of the SIMT emulation (see simt_compat.h for the model and the
// checks). Single OS thread: CUDA threads are fibers whose stacks are switched
// by simt_switch below (x86-64 SysV: callee-saved registers, MXCSR and the x87
// control word are all a cooperative switch has to keep).
#include "simt_compat.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdarg>
#include <cstdlib>
#include <map>
#include <random>
#include <string>
#include <vector>

#if !defined(__x86_64__)
#error "the SIMT harness switches fiber stacks with x86-64 assembly"
#endif

extern "C" void simt_switch(void** save_sp, void* new_sp);
extern "C" void simt_trampoline();
extern "C" void simt_fiber_main(void* fiber);

asm(R"(
.text
.globl simt_switch
.type simt_switch,@function
simt_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size simt_switch,.-simt_switch

.globl simt_trampoline
.type simt_trampoline,@function
simt_trampoline:
  movq %r12, %rdi
  call simt_fiber_main
  ud2
.size simt_trampoline,.-simt_trampoline
)");

namespace simt {

bool g_in_kernel = false;

namespace {

struct Options {
  uint64_t seed = 1;
  double preempt = 0.0;  // probability of a switch at a memory access
  int resident = 1;      // blocks run concurrently (in blockIdx order, like the hardware)
  bool checks = true;    // shared-memory race / init checks
  size_t stack = 256 * 1024;
};

Options read_options() {
  Options o;
  if (const char* s = std::getenv("SIMT_SEED")) o.seed = std::strtoull(s, nullptr, 10);
  if (const char* s = std::getenv("SIMT_PREEMPT")) o.preempt = std::atof(s);
  if (const char* s = std::getenv("SIMT_RESIDENT")) o.resident = std::max(1, std::atoi(s));
  if (const char* s = std::getenv("SIMT_CHECKS")) o.checks = std::atoi(s) != 0;
  return o;
}

Options g_opt = read_options();
std::mt19937_64 g_rng(g_opt.seed);

struct Block;

enum class St { kRunnable, kBarrier, kCollective, kDone };

struct Fiber {
  ThreadCtx ctx;
  void* sp = nullptr;
  char* stack = nullptr;
  St st = St::kRunnable;
  Block* block = nullptr;
  const char* file = nullptr;  // site of the barrier / collective it waits at
  int line = 0;
  int op = 0;
  unsigned mask = 0;
  uint64_t value = 0;
  int arg = 0;
  int width = 32;
  uint64_t result = 0;
};

struct Shadow {
  uint64_t gen = 0;
  uint32_t w_tid = 0, w_epoch = 0, w_wep = 0;
  uint32_t r_tid[2] = {0, 0}, r_epoch[2] = {0, 0}, r_wep[2] = {0, 0};
  uint8_t nr = 0, w_atomic = 0, written = 0, has_w = 0;
};

struct Block {
  dim3 idx;
  uint64_t linear = 0;
  std::vector<Fiber> fibers;
  int live = 0, at_barrier = 0;
  uint32_t epoch = 1;
  std::vector<uint32_t> warp_epoch;
  std::vector<unsigned char> arena;
  std::vector<Shadow> shadow;
  std::map<const void*, size_t> statics;
  size_t static_used = 0, dyn_offset = 0;
  uint64_t gen = 0;
  bool loads_now = false, cold_now = false;
  uint64_t load_intervals = 0, cold_intervals = 0, barriers = 0, bytes = 0;
  std::vector<uint64_t> warp_collectives;
};

constexpr size_t kStaticSmem = 64 * 1024;

struct Buffer {
  const char* base;
  size_t size;
  std::string name;
  std::vector<uint64_t> rd, wr;  // 32-byte sectors touched in this launch
  std::vector<uint64_t> hot;     // sectors written by any launch so far (L2-resident)
};

std::vector<Buffer> g_buffers;
size_t g_last_buf = 0;

struct LaunchStats {
  std::string name;
  uint64_t blocks = 0, threads = 0, smem = 0;
  uint64_t bytes_read = 0, bytes_written = 0, sectors_read = 0, sectors_written = 0;
  uint64_t max_load_intervals = 0, max_cold_intervals = 0, max_barriers = 0;
  uint64_t max_block_bytes = 0, max_warp_collectives = 0;
};
std::vector<LaunchStats> g_launches;
LaunchStats* g_cur_launch = nullptr;

const char* g_kernel = "";
dim3 g_grid, g_block;
size_t g_dyn_smem = 0;
Fiber* g_cur = nullptr;
void* g_sched_sp = nullptr;
const KernelBody* g_body = nullptr;
uint64_t g_gen = 0;
std::vector<char*> g_stack_pool;

char* get_stack() {
  if (!g_stack_pool.empty()) {
    char* s = g_stack_pool.back();
    g_stack_pool.pop_back();
    return s;
  }
  void* m = mmap(nullptr, g_opt.stack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) fail("cannot allocate a fiber stack");
  mprotect(m, 4096, PROT_NONE);  // guard page: a stack overflow faults instead of corrupting
  return static_cast<char*>(m);
}

void yield_to_scheduler() { simt_switch(&g_cur->sp, g_sched_sp); }

void init_fiber(Fiber& f) {
  f.stack = get_stack();
  uint64_t* top = reinterpret_cast<uint64_t*>(f.stack + g_opt.stack);
  top -= 2;  // keeps %rsp % 16 == 0 after `ret` into the trampoline
  uint64_t* sp = top;
  *--sp = reinterpret_cast<uint64_t>(&simt_trampoline);  // return address
  *--sp = 0;                                              // rbp
  *--sp = 0;                                              // rbx
  *--sp = reinterpret_cast<uint64_t>(&f);                 // r12 -> fiber
  *--sp = 0;                                              // r13
  *--sp = 0;                                              // r14
  *--sp = 0;                                              // r15
  *--sp = 0x037F00001F80ull;                              // mxcsr | x87 control word
  f.sp = sp;
}

std::string where(const Fiber* f) {
  char buf[256];
  if (f == nullptr) return std::string(g_kernel);
  std::snprintf(buf, sizeof(buf), "%s block (%u,%u,%u) thread %d", g_kernel, f->block->idx.x,
                f->block->idx.y, f->block->idx.z, f->ctx.linear);
  return buf;
}

void check_barrier(Block& b) {
  if (b.at_barrier == 0) return;
  const bool exited = b.live < static_cast<int>(b.fibers.size());
  if (!exited && b.at_barrier < b.live) return;  // still arriving: checked once complete
  const Fiber* first = nullptr;
  for (auto& f : b.fibers) {
    if (f.st != St::kBarrier) continue;
    if (exited) {
      fail("barrier divergence: %s waits at __syncthreads (%s:%d) after another thread of its "
           "block exited", where(&f).c_str(), f.file, f.line);
    }
    if (first == nullptr) {
      first = &f;
    } else if (f.line != first->line || std::strcmp(f.file, first->file) != 0) {
      fail("barrier divergence in %s: threads %d and %d wait at different __syncthreads "
           "(%s:%d vs %s:%d)", where(first).c_str(), first->ctx.linear, f.ctx.linear,
           first->file, first->line, f.file, f.line);
    }
  }
  b.at_barrier = 0;
  ++b.epoch;
  ++b.barriers;
  if (b.loads_now) ++b.load_intervals;
  if (b.cold_now) ++b.cold_intervals;
  b.loads_now = b.cold_now = false;
}

void complete_collective(Block& b, int warp, std::vector<Fiber*>& runnable, Fiber* arrived);

}  // namespace

// --------------------------------------------------------------- public API
ThreadCtx* cur() { return &g_cur->ctx; }
const dim3& block_idx() { return g_cur->block->idx; }
const dim3& block_dim() { return g_block; }
const dim3& grid_dim() { return g_grid; }
cudaError_t last_error() { return cudaSuccess; }

void fail(const char* fmt, ...) {
  std::fflush(stdout);
  std::fprintf(stderr, "SIMT ERROR [%s]: ", where(g_cur).c_str());
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stderr, fmt, ap);
  va_end(ap);
  std::fprintf(stderr, "\n");
  std::fflush(stderr);
  std::_Exit(3);
}

void maybe_preempt() {
  if (g_cur == nullptr || g_opt.preempt <= 0.0) return;
  if (std::uniform_real_distribution<double>(0.0, 1.0)(g_rng) < g_opt.preempt) {
    yield_to_scheduler();
  }
}

void nanosleep_yield() {
  if (g_cur != nullptr) yield_to_scheduler();
}

void syncthreads(const char* file, int line) {
  Fiber* f = g_cur;
  f->st = St::kBarrier;
  f->file = file;
  f->line = line;
  ++f->block->at_barrier;
  yield_to_scheduler();
}

uint64_t warp_collective(int op, unsigned mask, uint64_t value, int arg, int width,
                         const char* file, int line) {
  Fiber* f = g_cur;
  const int lane = f->ctx.linear & 31;
  if (!(mask & (1u << lane))) {
    fail("warp collective at %s:%d by lane %d which is not in its mask %08x", file, line, lane,
         mask);
  }
  f->st = St::kCollective;
  f->op = op;
  f->mask = mask;
  f->value = value;
  f->arg = arg;
  f->width = width;
  f->file = file;
  f->line = line;
  yield_to_scheduler();
  return f->result;
}

void syncwarp(unsigned mask, const char* file, int line) {
  warp_collective(-1, mask, 0, 0, 32, file, line);
}

void register_buffer(const void* p, size_t bytes, const char* name) {
  Buffer b;
  b.base = static_cast<const char*>(p);
  b.size = bytes;
  b.name = name;
  b.rd.assign((bytes + 32 * 64 - 1) / (32 * 64) + 1, 0);
  b.wr.assign(b.rd.size(), 0);
  b.hot.assign(b.rd.size(), 0);
  g_buffers.push_back(std::move(b));
}

void global_access(const void* p, size_t bytes, bool write, bool atomic) {
  (void)atomic;
  const char* c = static_cast<const char*>(p);
  Buffer* buf = nullptr;
  if (g_last_buf < g_buffers.size()) {
    Buffer& b = g_buffers[g_last_buf];
    if (c >= b.base && c + bytes <= b.base + b.size) buf = &b;
  }
  if (buf == nullptr) {
    for (size_t i = 0; i < g_buffers.size(); ++i) {
      Buffer& b = g_buffers[i];
      if (c >= b.base && c + bytes <= b.base + b.size) {
        buf = &b;
        g_last_buf = i;
        break;
      }
    }
  }
  if (buf == nullptr) {
    std::string near = "none";
    for (auto& b : g_buffers) {
      if (c >= b.base - 4096 && c < b.base + b.size + 4096) near = b.name;
    }
    fail("global %s of %zu bytes at %p outside every registered buffer (nearest: %s)",
         write ? "write" : "read", bytes, p, near.c_str());
  }
  if (g_cur_launch == nullptr) return;
  const size_t off = static_cast<size_t>(c - buf->base);
  const size_t s0 = off / 32, s1 = (off + bytes - 1) / 32;
  std::vector<uint64_t>& bits = write ? buf->wr : buf->rd;
  bool cold = false;
  for (size_t s = s0; s <= s1; ++s) {
    bits[s >> 6] |= 1ull << (s & 63);
    if (write) buf->hot[s >> 6] |= 1ull << (s & 63);
    else if (!(buf->hot[s >> 6] & (1ull << (s & 63)))) cold = true;
  }
  if (write) {
    g_cur_launch->bytes_written += bytes;
    if (atomic) g_cur_launch->bytes_read += bytes;
  } else {
    g_cur_launch->bytes_read += bytes;
  }
  if (g_cur != nullptr) {
    Block* b = g_cur->block;
    b->bytes += bytes;
    if (!write || atomic) b->loads_now = true;
    if (!write && cold) b->cold_now = true;
  }
}

void global_prefetch(const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (auto& b : g_buffers) {
    if (c < b.base || c >= b.base + b.size) continue;
    const size_t off = static_cast<size_t>(c - b.base);
    const size_t end = std::min(b.size, off + bytes);
    for (size_t s = off / 32; s <= (end - 1) / 32; ++s) {
      b.rd[s >> 6] |= 1ull << (s & 63);
      b.hot[s >> 6] |= 1ull << (s & 63);
    }
    return;
  }
  // Like the hardware, a prefetch outside any allocation is ignored.
}

unsigned char* smem_static_alloc(const void* key, size_t bytes, size_t align) {
  Block* b = g_cur->block;
  auto it = b->statics.find(key);
  if (it != b->statics.end()) return b->arena.data() + it->second;
  size_t off = (b->static_used + align - 1) / align * align;
  if (off + bytes > kStaticSmem) fail("static shared memory above %zu bytes", kStaticSmem);
  b->statics[key] = off;
  b->static_used = off + bytes;
  return b->arena.data() + off;
}

unsigned char* smem_dynamic() { return g_cur->block->arena.data() + g_cur->block->dyn_offset; }

void smem_access(const void* p, size_t bytes, int kind) {
  Fiber* f = g_cur;
  Block& b = *f->block;
  const unsigned char* c = static_cast<const unsigned char*>(p);
  if (c < b.arena.data() || c + bytes > b.arena.data() + b.arena.size() ||
      (c >= b.arena.data() + b.static_used && c < b.arena.data() + b.dyn_offset)) {
    fail("shared-memory access of %zu bytes outside the block's allocations (offset %td)", bytes,
         c - b.arena.data());
  }
  if (!g_opt.checks) return;
  const uint32_t me = static_cast<uint32_t>(f->ctx.linear);
  const uint32_t warp = me >> 5;
  const size_t w0 = static_cast<size_t>(c - b.arena.data()) / 4;
  const size_t w1 = (static_cast<size_t>(c - b.arena.data()) + bytes - 1) / 4;
  auto conflict = [&](uint32_t tid, uint32_t epoch, uint32_t wep) {
    if (tid == me || epoch != b.epoch) return false;
    if ((tid >> 5) == warp && wep != b.warp_epoch[warp]) return false;  // __syncwarp between
    return true;
  };
  for (size_t w = w0; w <= w1; ++w) {
    Shadow& s = b.shadow[w];
    if (s.gen != b.gen) s = Shadow{b.gen};
    if (kind != 1 && !s.written) {
      fail("read of uninitialised shared memory (offset %zu)", w * 4);
    }
    if (s.has_w && conflict(s.w_tid, s.w_epoch, s.w_wep) && !(kind == 2 && s.w_atomic)) {
      fail("shared-memory race at offset %zu: %s by thread %u after a %s by thread %u in the "
           "same barrier interval", w * 4, kind == 0 ? "read" : kind == 1 ? "write" : "atomic",
           me, s.w_atomic ? "atomic" : "write", s.w_tid);
    }
    if (kind == 0) {
      int slot = -1;
      for (int r = 0; r < s.nr; ++r) if (s.r_tid[r] == me) slot = r;
      if (slot < 0) {
        if (s.nr < 2) {
          slot = s.nr++;
        } else {
          s.r_tid[0] = s.r_tid[1];
          s.r_epoch[0] = s.r_epoch[1];
          s.r_wep[0] = s.r_wep[1];
          slot = 1;
        }
      }
      s.r_tid[slot] = me;
      s.r_epoch[slot] = b.epoch;
      s.r_wep[slot] = b.warp_epoch[warp];
    } else {
      for (int r = 0; r < s.nr; ++r) {
        if (conflict(s.r_tid[r], s.r_epoch[r], s.r_wep[r])) {
          fail("shared-memory race at offset %zu: %s by thread %u after a read by thread %u in "
               "the same barrier interval", w * 4, kind == 1 ? "write" : "atomic", me,
               s.r_tid[r]);
        }
      }
      s.nr = 0;
      s.has_w = 1;
      s.written = 1;
      s.w_atomic = kind == 2;
      s.w_tid = me;
      s.w_epoch = b.epoch;
      s.w_wep = b.warp_epoch[warp];
    }
  }
}

namespace {

void complete_collective(Block& b, int warp, std::vector<Fiber*>& runnable, Fiber* arrived) {
  const int n = static_cast<int>(b.fibers.size());
  const int base = warp * 32;
  Fiber* lanes[32] = {};
  unsigned present = 0;
  for (int l = 0; l < 32 && base + l < n; ++l) {
    lanes[l] = &b.fibers[base + l];
    present |= 1u << l;
  }
  // Only the group of the lane that just arrived (or, when a lane exited,
  // every waiting group) can have become complete.
  for (int l = 0; l < 32; ++l) {
    Fiber* f = lanes[l];
    if (f == nullptr || f->st != St::kCollective) continue;
    if (arrived != nullptr && f != arrived) continue;
    const unsigned m = f->mask & present;
    bool all = true;
    for (int k = 0; k < 32; ++k) {
      if (!(m & (1u << k))) continue;
      Fiber* g = lanes[k];
      if (g->st == St::kDone) {
        fail("warp collective at %s:%d: lane %d of its mask %08x has exited", f->file, f->line,
             k, f->mask);
      }
      if (g->st != St::kCollective) { all = false; break; }
      if (g->mask != f->mask || g->line != f->line || g->op != f->op ||
          std::strcmp(g->file, f->file) != 0) {
        fail("warp divergence: lanes %d and %d of warp %d wait at different collectives "
             "(%s:%d mask %08x vs %s:%d mask %08x)", l, k, warp, f->file, f->line, f->mask,
             g->file, g->line, g->mask);
      }
    }
    if (!all) continue;
    for (int k = 0; k < 32; ++k) {
      if (!(m & (1u << k))) continue;
      Fiber* g = lanes[k];
      const int w = g->width <= 0 ? 32 : g->width;
      const int seg = k & ~(w - 1), pos = k & (w - 1);
      int src = k;
      switch (g->op) {
        case kShflIdx: src = seg + (g->arg & (w - 1)); break;
        case kShflXor: { const int t = pos ^ g->arg; src = t < w ? seg + t : k; break; }
        case kShflDown: src = pos + g->arg < w ? k + g->arg : k; break;
        case kShflUp: src = pos - g->arg >= 0 ? k - g->arg : k; break;
        default: break;
      }
      if (g->op >= kShflIdx && g->op <= kShflUp) {
        if (!(m & (1u << src))) {
          fail("shuffle at %s:%d: lane %d reads lane %d outside the mask %08x", g->file, g->line,
               k, src, g->mask);
        }
        g->result = lanes[src]->value;
      } else if (g->op == kBallot || g->op == kAny || g->op == kAll) {
        unsigned bits = 0;
        for (int q = 0; q < 32; ++q) {
          if ((m & (1u << q)) && lanes[q]->value) bits |= 1u << q;
        }
        g->result = g->op == kBallot ? bits : g->op == kAny ? (bits != 0) : (bits == m);
      }
    }
    if (f->op == -1 && m == present) ++b.warp_epoch[warp];  // full-warp __syncwarp orders memory
    ++b.warp_collectives[warp];
    for (int k = 0; k < 32; ++k) {
      if (m & (1u << k)) {
        lanes[k]->st = St::kRunnable;
        runnable.push_back(lanes[k]);
      }
    }
    if (arrived != nullptr) return;
  }
}

void start_block(Block& b, uint64_t linear, size_t nthreads) {
  b.linear = linear;
  b.idx = dim3(static_cast<unsigned>(linear % g_grid.x),
               static_cast<unsigned>((linear / g_grid.x) % g_grid.y),
               static_cast<unsigned>(linear / (static_cast<uint64_t>(g_grid.x) * g_grid.y)));
  b.fibers.assign(nthreads, Fiber{});
  b.live = static_cast<int>(nthreads);
  b.at_barrier = 0;
  b.epoch = 1;
  b.warp_epoch.assign((nthreads + 31) / 32, 1);
  b.dyn_offset = kStaticSmem;
  b.arena.resize(kStaticSmem + g_dyn_smem);
  if (g_opt.checks) b.shadow.resize(b.arena.size() / 4 + 1);
  b.statics.clear();
  b.static_used = 0;
  b.gen = ++g_gen;
  b.loads_now = b.cold_now = false;
  b.load_intervals = b.cold_intervals = b.barriers = b.bytes = 0;
  b.warp_collectives.assign((nthreads + 31) / 32, 0);
  for (size_t t = 0; t < nthreads; ++t) {
    Fiber& f = b.fibers[t];
    f.ctx.linear = static_cast<int>(t);
    f.ctx.tid = dim3(static_cast<unsigned>(t % g_block.x),
                     static_cast<unsigned>((t / g_block.x) % g_block.y),
                     static_cast<unsigned>(t / (g_block.x * g_block.y)));
    f.block = &b;
    init_fiber(f);
  }
}

}  // namespace

cudaError_t launch(const char* name, dim3 grid, dim3 block, size_t smem, KernelBody body) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return cudaSuccess;
  g_kernel = name;
  g_grid = grid;
  g_block = block;
  g_dyn_smem = smem;
  g_body = &body;
  g_launches.push_back(LaunchStats{});
  g_cur_launch = &g_launches.back();
  const uint64_t nblocks = static_cast<uint64_t>(grid.x) * grid.y * grid.z;
  const size_t nthreads = static_cast<size_t>(block.x) * block.y * block.z;
  g_cur_launch->name = name;
  g_cur_launch->blocks = nblocks;
  g_cur_launch->threads = nthreads;
  g_cur_launch->smem = smem;
  g_in_kernel = true;

  std::vector<Block> slots(static_cast<size_t>(g_opt.resident));
  std::vector<bool> busy(slots.size(), false);
  std::vector<Fiber*> runnable;
  uint64_t next = 0;
  size_t active = 0;
  auto fill = [&] {
    for (size_t s = 0; s < slots.size() && next < nblocks; ++s) {
      if (busy[s]) continue;
      start_block(slots[s], next++, nthreads);
      busy[s] = true;
      ++active;
      for (auto& f : slots[s].fibers) runnable.push_back(&f);
    }
  };
  fill();
  while (active > 0) {
    if (runnable.empty()) {
      std::string msg;
      for (size_t s = 0; s < slots.size(); ++s) {
        if (!busy[s]) continue;
        for (auto& f : slots[s].fibers) {
          if (f.st == St::kBarrier || f.st == St::kCollective) {
            char buf[200];
            std::snprintf(buf, sizeof(buf), "\n  %s waits at %s:%d", where(&f).c_str(), f.file,
                          f.line);
            msg += buf;
            if (msg.size() > 1500) break;
          }
        }
      }
      g_cur = nullptr;
      fail("deadlock (barrier or warp divergence): no thread can run:%s", msg.c_str());
    }
    const size_t pick = std::uniform_int_distribution<size_t>(0, runnable.size() - 1)(g_rng);
    Fiber* f = runnable[pick];
    runnable[pick] = runnable.back();
    runnable.pop_back();
    g_cur = f;
    simt_switch(&g_sched_sp, f->sp);
    g_cur = nullptr;
    Block& b = *f->block;
    if (f->st == St::kRunnable) {
      runnable.push_back(f);
    } else if (f->st == St::kBarrier) {
      check_barrier(b);
      if (b.at_barrier == 0) {
        for (auto& g : b.fibers) {
          if (g.st == St::kBarrier) {
            g.st = St::kRunnable;
            runnable.push_back(&g);
          }
        }
      }
    } else if (f->st == St::kCollective) {
      complete_collective(b, f->ctx.linear >> 5, runnable, f);
    } else if (f->st == St::kDone) {
      --b.live;
      g_stack_pool.push_back(f->stack);
      check_barrier(b);
      complete_collective(b, f->ctx.linear >> 5, runnable, nullptr);
      if (b.live == 0) {
        if (b.loads_now) ++b.load_intervals;
        if (b.cold_now) ++b.cold_intervals;
        LaunchStats& L = *g_cur_launch;
        if (std::getenv("SIMT_VERBOSE") != nullptr && b.linear < 4) {
          std::fprintf(stderr, "%s block %llu: load intervals %llu (cold %llu), barriers %llu, "
                       "bytes %llu\n", g_kernel, (unsigned long long)b.linear,
                       (unsigned long long)b.load_intervals, (unsigned long long)b.cold_intervals,
                       (unsigned long long)b.barriers, (unsigned long long)b.bytes);
        }
        L.max_load_intervals = std::max<uint64_t>(L.max_load_intervals, b.load_intervals);
        L.max_cold_intervals = std::max<uint64_t>(L.max_cold_intervals, b.cold_intervals);
        for (uint64_t c : b.warp_collectives) {
          L.max_warp_collectives = std::max<uint64_t>(L.max_warp_collectives, c);
        }
        L.max_barriers = std::max<uint64_t>(L.max_barriers, b.barriers);
        L.max_block_bytes = std::max<uint64_t>(L.max_block_bytes, b.bytes);
        for (size_t s = 0; s < slots.size(); ++s) {
          if (&slots[s] == &b) busy[s] = false;
        }
        --active;
        fill();
      }
    }
  }
  g_in_kernel = false;
  for (auto& buf : g_buffers) {
    for (auto& w : buf.rd) { g_cur_launch->sectors_read += __builtin_popcountll(w); w = 0; }
    for (auto& w : buf.wr) { g_cur_launch->sectors_written += __builtin_popcountll(w); w = 0; }
  }
  g_cur_launch = nullptr;
  return cudaSuccess;
}

void write_launch_stats(FILE* out) {
  std::fprintf(out, "[");
  for (size_t i = 0; i < g_launches.size(); ++i) {
    const LaunchStats& L = g_launches[i];
    std::fprintf(out,
                 "%s{\"name\": \"%s\", \"blocks\": %llu, \"threads\": %llu, \"smem\": %llu, "
                 "\"bytes_read\": %llu, \"bytes_written\": %llu, \"dram_read\": %llu, "
                 "\"dram_written\": %llu, \"max_load_intervals\": %llu, \"max_barriers\": %llu, "
                 "\"max_block_bytes\": %llu, \"max_cold_intervals\": %llu, "
                 "\"max_warp_collectives\": %llu}",
                 i ? ", " : "", L.name.c_str(), (unsigned long long)L.blocks,
                 (unsigned long long)L.threads, (unsigned long long)L.smem,
                 (unsigned long long)L.bytes_read, (unsigned long long)L.bytes_written,
                 (unsigned long long)(L.sectors_read * 32),
                 (unsigned long long)(L.sectors_written * 32),
                 (unsigned long long)L.max_load_intervals, (unsigned long long)L.max_barriers,
                 (unsigned long long)L.max_block_bytes,
                 (unsigned long long)L.max_cold_intervals,
                 (unsigned long long)L.max_warp_collectives);
  }
  std::fprintf(out, "]");
}

}  // namespace simt

extern "C" void simt_fiber_main(void* p) {
  simt::Fiber* f = static_cast<simt::Fiber*>(p);
  (*simt::g_body)();
  f->st = simt::St::kDone;
  ::simt_switch(&f->sp, simt::g_sched_sp);
  __builtin_trap();
}
