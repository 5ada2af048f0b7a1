// The native kernels of one batch-1 decode step of the bench model, called directly (no MindSpore), each timed
// against its floor: the bytes it must read over this machine's streaming-read bandwidth (measured here too).
//
//     g++ -O3 -march=native -fopenmp-simd -fno-math-errno -pthread -std=c++17 scripts/bench_decode_kernels.cc \
//         agents/model/kernels/*.cc -o /tmp/bench_decode_kernels
//     /tmp/bench_decode_kernels [steps] [context] [gap_us]
//
// Why: a bench token is ~5 ms in process and MindSpore's launches explain ~0.35 ms of it (docs/benchmarks.md, "What
// a kernel launch costs"); this shows how much of the rest each kernel takes and how far it is from memory speed.
// Bench model (scripts/benchmark.py): hidden 512, ffn 1408, 8 layers, 8 heads / 4 kv heads of 64, vocab 8000, f32.
// Each layer has its own weights (110 MB in all, as in the model: a step reads every weight once) and the ops run
// in a step's order. Reports per op the median over steps of wall time and of the process's CPU time (all threads:
// the machine is shared, so wall time counts other processes' turns), and the op's CPU floor: its bytes over the
// per-thread streaming-read bandwidth measured here by CPU time. Run with LLM_SERVING_KERNEL_SPIN_US=0 to count
// work only (a polling helper's wait counts as CPU time otherwise). ``caller``: the calling thread's own CPU time,
// the step's critical path on a quiet machine (it does not count its waits for a helper that another process's
// turn delayed, which wall time does). ``p10 wall``: the 10th percentile over steps, the uninterrupted ones.
// Threads: $LLM_SERVING_KERNEL_THREADS (as the agent). ``gap_us``: the calling thread busy for that long after each
// op, as MindSpore's runtime is between two ops of the step graph (tens of microseconds, docs/benchmarks.md "Where
// the one-stream token goes"); the step's wall and CPU then include the gaps, the ops' own figures do not.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>
#include <thread>
#include <vector>

#define KERNEL(name)                                                                                         \
  extern "C" int name(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, \
                      void *)
KERNEL(NormLinear);
KERNEL(NormSwiGlu);
KERNEL(ResidualLinear);
KERNEL(PagedDecodeAttention);
KERNEL(GreedyPick);
extern "C" void KernelHelpersPoll(int on);

namespace {

constexpr int64_t kHidden = 512, kFfn = 1408, kLayers = 8, kHeads = 8, kKv = 4, kDim = 64, kVocab = 8000;
constexpr int64_t kBlock = 16, kQkv = (kHeads + 2 * kKv) * kDim;

double wall_now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

double cpu_now() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

// One custom op's call: its buffers' pointers, ranks, shapes and dtypes, as MindSpore passes them.
struct Call {
  std::vector<void *> params;
  std::vector<int> ndims;
  std::vector<std::vector<int64_t>> shape_store;
  std::vector<int64_t *> shapes;
  std::vector<const char *> dtypes;

  void add(void *p, std::vector<int64_t> shape, const char *dtype) {
    params.push_back(p);
    ndims.push_back(static_cast<int>(shape.size()));
    shape_store.push_back(std::move(shape));
    dtypes.push_back(dtype);
  }
  int run(decltype(&NormLinear) fn) {
    shapes.clear();
    for (auto &s : shape_store) shapes.push_back(s.data());
    return fn(static_cast<int>(params.size()), params.data(), ndims.data(), shapes.data(), dtypes.data(), nullptr,
              nullptr);
  }
};

std::vector<float> filled(int64_t n, float scale) {
  std::vector<float> v(static_cast<size_t>(n));
  uint32_t s = 12345u + static_cast<uint32_t>(n);
  for (auto &x : v) {
    s = s * 1664525u + 1013904223u;
    x = scale * (static_cast<float>(s >> 8) / 16777216.0f - 0.5f);
  }
  return v;
}

double thread_cpu_now() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

// GB/s of reading ``bytes`` of float32 with ``threads`` threads, each over its own share, by each thread's CPU
// time (the machine is shared: wall time counts other processes' turns), summed over threads; median of ``reps``.
double read_bandwidth(int64_t bytes, int threads, int reps) {
  std::vector<float> data = filled(bytes / 4, 1.0f);
  std::vector<float> sums(static_cast<size_t>(threads) * 64);
  std::vector<double> rates;
  for (int r = 0; r < reps; ++r) {
    std::vector<double> seconds(static_cast<size_t>(threads));
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        const double t0 = thread_cpu_now();
        const int64_t n = static_cast<int64_t>(data.size()), begin = n * t / threads, end = n * (t + 1) / threads;
        float acc[64] = {};  // four vector accumulators: bound by the loads, not an add's latency
        for (int64_t i = begin; i + 64 <= end; i += 64) {
          __builtin_prefetch(data.data() + i + 4096);  // 16 KB ahead (measured best of 0-16 KB here)
#pragma omp simd
          for (int j = 0; j < 64; ++j) acc[j] += data[static_cast<size_t>(i + j)];
        }
        for (int j = 0; j < 64; ++j) sums[static_cast<size_t>(t * 64 + j)] = acc[j];
        seconds[static_cast<size_t>(t)] = thread_cpu_now() - t0;
      });
    }
    for (auto &p : pool) p.join();
    double rate = 0.0;
    for (int t = 0; t < threads; ++t) rate += static_cast<double>(bytes) / threads / seconds[static_cast<size_t>(t)];
    rates.push_back(rate / 1e9);
  }
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The 10th percentile: on a shared machine, the steps (or ops) that other processes did not interrupt; an estimate
// of the quiet machine's wall time.
double low(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 10];
}

}  // namespace

int main(int argc, char **argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 200;
  const int64_t context = argc > 2 ? std::atoll(argv[2]) : 256;
  const double gap = argc > 3 ? std::atof(argv[3]) * 1e-6 : 0.0;
  const int threads = static_cast<int>(std::getenv("LLM_SERVING_KERNEL_THREADS")
                                           ? std::atoll(std::getenv("LLM_SERVING_KERNEL_THREADS"))
                                           : std::thread::hardware_concurrency());
  const double bw1 = read_bandwidth(int64_t{110} << 20, 1, 9), bw2 = read_bandwidth(int64_t{110} << 20, 2, 9);
  // CPU-seconds floor per byte: all threads together read at bw2 (two threads) or bw1, each thread busy throughout.
  const double bw = threads > 1 ? bw2 / 2 : bw1;
  std::printf("streaming read of 110 MB: %.1f GB/s 1 thread, %.1f GB/s 2 threads; kernel threads %d\n", bw1, bw2,
              threads);

  // Packed weights per layer (float32 panels of 32 columns: [panels * K, 32]).
  struct LayerWeights {
    std::vector<float> norm1, qkv, o, norm2, gate_up, down, cache;
  };
  std::vector<LayerWeights> layers(kLayers);
  const int64_t blocks = (context + kBlock) / kBlock + 2, slots = blocks * kBlock;
  for (auto &l : layers) {
    l.norm1 = filled(kHidden, 2.0f);
    l.norm2 = filled(kHidden, 2.0f);
    l.qkv = filled(kQkv / 32 * kHidden * 32, 0.1f);
    l.o = filled(kHidden / 32 * kHidden * 32, 0.1f);
    l.gate_up = filled(kFfn / 16 * kHidden * 32, 0.1f);
    l.down = filled(kHidden / 32 * kFfn * 32, 0.1f);
    l.cache = filled(2 * kKv * slots * kDim, 1.0f);
  }
  std::vector<float> final_norm = filled(kHidden, 2.0f), lm_head = filled((kVocab + 31) / 32 * kHidden * 32, 0.1f);
  std::vector<float> x = filled(kHidden, 1.0f), qkv(kQkv), attn(kHidden), h1(kHidden), act(kFfn), logits(kVocab);
  std::vector<float> cos_t = filled(kDim, 1.0f), sin_t = filled(kDim, 1.0f), eps = {1e-6f}, lp(1);
  std::vector<int32_t> rows = {1}, slot = {static_cast<int32_t>(context - 1)}, lens = {static_cast<int32_t>(context)};
  std::vector<int32_t> table(static_cast<size_t>(blocks)), offsets(kBlock), ids(1);
  for (int64_t i = 0; i < blocks; ++i) table[static_cast<size_t>(i)] = static_cast<int32_t>(i);

  const char *f32 = "float32", *i32 = "int32";
  enum Op { kQkvOp, kAttn, kOProj, kGateUp, kDown, kLmHead, kGreedy, kOps };
  const char *names[kOps] = {"NormLinear qkv 512->1024", "PagedDecodeAttention", "ResidualLinear o 512->512",
                             "NormSwiGlu 512->2x1408", "ResidualLinear down 1408->512", "NormLinear lm_head 512->8000",
                             "GreedyPick 8000"};
  const double bytes[kOps] = {4.0 * kHidden * kQkv, 4.0 * 2 * kKv * context * kDim, 4.0 * kHidden * kHidden,
                              4.0 * kHidden * 2 * kFfn, 4.0 * kFfn * kHidden, 4.0 * kHidden * kVocab, 4.0 * kVocab};
  const int per_step[kOps] = {kLayers, kLayers, kLayers, kLayers, kLayers, 1, 1};
  std::vector<std::vector<double>> wall(kOps), cpu(kOps), caller(kOps);
  std::vector<double> step_wall, step_cpu, step_caller;
  std::vector<double> w(kOps), c(kOps), m(kOps);
  auto timed = [&](Op op, auto &&body) {
    const double t0 = wall_now(), c0 = cpu_now(), m0 = thread_cpu_now();
    if (body() != 0) {
      std::fprintf(stderr, "%s failed\n", names[op]);
      std::exit(1);
    }
    w[op] += wall_now() - t0;
    c[op] += cpu_now() - c0;
    m[op] += thread_cpu_now() - m0;
    for (const double until = wall_now() + gap; wall_now() < until;) {
    }
  };
  for (int s = 0; s < steps + 5; ++s) {
    KernelHelpersPoll(1);
    std::fill(w.begin(), w.end(), 0.0);
    std::fill(c.begin(), c.end(), 0.0);
    std::fill(m.begin(), m.end(), 0.0);
    const double t0 = wall_now(), c0 = cpu_now(), m0 = thread_cpu_now();
    for (auto &l : layers) {
      timed(kQkvOp, [&] {
        Call k;
        k.add(x.data(), {1, kHidden}, f32); k.add(l.norm1.data(), {kHidden}, f32); k.add(eps.data(), {1}, f32);
        k.add(l.qkv.data(), {kQkv / 32 * kHidden, 32}, f32); k.add(rows.data(), {1}, i32);
        k.add(qkv.data(), {1, kQkv}, f32);
        return k.run(NormLinear);
      });
      timed(kAttn, [&] {
        Call k;
        k.add(qkv.data(), {1, kQkv}, f32); k.add(cos_t.data(), {1, kDim}, f32); k.add(sin_t.data(), {1, kDim}, f32);
        k.add(slot.data(), {1}, i32); k.add(table.data(), {1, blocks}, i32); k.add(lens.data(), {1}, i32);
        k.add(offsets.data(), {kBlock}, i32); k.add(l.cache.data(), {2 * kKv, slots, kDim}, f32);
        k.add(attn.data(), {1, kHidden}, f32);
        return k.run(PagedDecodeAttention);
      });
      timed(kOProj, [&] {
        Call k;
        k.add(attn.data(), {1, kHidden}, f32); k.add(l.o.data(), {kHidden / 32 * kHidden, 32}, f32);
        k.add(x.data(), {1, kHidden}, f32); k.add(rows.data(), {1}, i32); k.add(h1.data(), {1, kHidden}, f32);
        return k.run(ResidualLinear);
      });
      timed(kGateUp, [&] {
        Call k;
        k.add(h1.data(), {1, kHidden}, f32); k.add(l.norm2.data(), {kHidden}, f32); k.add(eps.data(), {1}, f32);
        k.add(l.gate_up.data(), {kFfn / 16 * kHidden, 32}, f32); k.add(rows.data(), {1}, i32);
        k.add(act.data(), {1, kFfn}, f32);
        return k.run(NormSwiGlu);
      });
      timed(kDown, [&] {
        Call k;
        k.add(act.data(), {1, kFfn}, f32); k.add(l.down.data(), {kHidden / 32 * kFfn, 32}, f32);
        k.add(h1.data(), {1, kHidden}, f32); k.add(rows.data(), {1}, i32); k.add(x.data(), {1, kHidden}, f32);
        return k.run(ResidualLinear);
      });
      for (auto &v : x) v *= 0.5f;  // keep the residual stream bounded across layers and steps
    }
    timed(kLmHead, [&] {
      Call k;
      k.add(x.data(), {1, kHidden}, f32); k.add(final_norm.data(), {kHidden}, f32); k.add(eps.data(), {1}, f32);
      k.add(lm_head.data(), {(kVocab + 31) / 32 * kHidden, 32}, f32); k.add(rows.data(), {1}, i32);
      k.add(logits.data(), {1, kVocab}, f32);
      return k.run(NormLinear);
    });
    timed(kGreedy, [&] {
      Call k;
      k.add(logits.data(), {1, kVocab}, f32); k.add(ids.data(), {1}, i32); k.add(lp.data(), {1}, f32);
      return k.run(GreedyPick);
    });
    const double sw = wall_now() - t0, sc = cpu_now() - c0, sm = thread_cpu_now() - m0;
    KernelHelpersPoll(0);
    if (s < 5) continue;  // warm-up
    for (int op = 0; op < kOps; ++op) {
      wall[op].push_back(w[op]);
      cpu[op].push_back(c[op]);
      caller[op].push_back(m[op]);
    }
    step_caller.push_back(sm);
    step_wall.push_back(sw);
    step_cpu.push_back(sc);
  }
  std::printf("%-30s %6s %9s %9s %9s %9s %9s %9s\n", "op (x per step)", "", "wall us", "p10 wall", "cpu us",
              "caller us", "floor us", "cpu/floor");
  double floor_total = 0.0;
  for (int op = 0; op < kOps; ++op) {
    const double floor = bytes[op] * per_step[op] / (bw * 1e9);
    floor_total += floor;
    std::printf("%-30s x%-5d %9.0f %9.0f %9.0f %9.0f %9.0f %8.2fx\n", names[op], per_step[op],
                median(wall[op]) * 1e6, low(wall[op]) * 1e6, median(cpu[op]) * 1e6, median(caller[op]) * 1e6, floor * 1e6, median(cpu[op]) / floor);
  }
  std::printf("%-30s %6s %9.0f %9.0f %9.0f %9.0f %9.0f %8.2fx  (context %ld, %d steps)\n", "step", "",
              median(step_wall) * 1e6, low(step_wall) * 1e6, median(step_cpu) * 1e6, median(step_caller) * 1e6, floor_total * 1e6,
              median(step_cpu) / floor_total, static_cast<long>(context), steps);
  return 0;
}
