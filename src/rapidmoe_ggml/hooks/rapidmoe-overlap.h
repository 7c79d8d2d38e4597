// Overlap of the CPU's residual work with the device's WQ work for the same layer (docs/execution.md).
//
// ggml's scheduler runs a graph's splits one after the other on the calling thread, so a CPU split never runs
// while a device split of the same graph computes. Two custom ops, pinned to the CPU backend, get around that:
//
//   begin(input, critical ids) -> R   copies its inputs, hands the masked residual matmuls to the residual
//                                     worker (its own thread and CPU backend) and returns at once
//   ... the device's WQ matmuls (the scheduler launches them next: CUDA and RPC compute asynchronously) ...
//   join(R, WQ results, ...)          waits for the worker, then combines (its inputs from the device arrive
//                                     first: the scheduler copies them before the CPU split starts)
//
// One pair around gate/up (WR residuals) and one around down (the high-precision copy or its residual):
// they meet at the operator boundaries where the SwiGLU and the weighted sum need both paths.
// R stays allocated until join reads it (it is join's input), and begin copies what the worker reads, so the
// graph allocator may reuse begin's inputs as soon as begin returns.
// Each begin gets a fresh task id (never reused, so a join can only ever meet its own begin's task) and leaves it in
// R's op_params for its join; the task is forgotten once every thread of the join has seen it. A task that fails
// (the worker's graph, an exception, begin itself) reaches join as an error: join fills its output with NaN and
// records the message in the model's sidecar state (rapidmoe_llama_take_worker_error); nothing terminates.
#pragma once

#include "ggml.h"
#include "ggml-backend.h"

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

struct rapidmoe_layer_residual;

enum rapidmoe_overlap_stage {
    RAPIDMOE_OVERLAP_GATE_UP = 0, // gate/up WR residuals of the critical slots || WQ gate/up of every slot
    RAPIDMOE_OVERLAP_DOWN    = 1, // the critical slots' down (copy or residual) || WQ down
    RAPIDMOE_OVERLAP_N_STAGES,
};

// When split layers use begin/join instead of plain residual nodes in the graph (read at graph build).
enum rapidmoe_overlap_mode {
    RAPIDMOE_OVERLAP_OFF  = 0,
    RAPIDMOE_OVERLAP_AUTO = 1, // layers whose WQ experts are not in host memory (a GPU, an RPC device)
    RAPIDMOE_OVERLAP_ON   = 2, // every split layer, also all-CPU (testing: same results, no speed-up)
};

// Sums over every begin/join pair of one stage since the last reset, in nanoseconds.
struct rapidmoe_overlap_timing {
    std::atomic<int64_t> n{0};
    std::atomic<int64_t> cpu_ns{0};    // the worker computing the residual matmuls
    std::atomic<int64_t> device_ns{0}; // begin returned -> join started: the device split(s) and their copies
    std::atomic<int64_t> wait_ns{0};   // join blocked on the worker after the device's results had arrived
    std::atomic<int64_t> wall_ns{0};   // begin started -> join finished: the stage as the layer sees it
};

// One thread with its own CPU backend that runs residual tasks in submission order.
class rapidmoe_residual_worker {
  public:
    using work_fn = std::function<void(ggml_backend_t)>;

    explicit rapidmoe_residual_worker(int n_threads);
    ~rapidmoe_residual_worker();
    rapidmoe_residual_worker(const rapidmoe_residual_worker &) = delete;
    rapidmoe_residual_worker & operator=(const rapidmoe_residual_worker &) = delete;

    void set_n_threads(int n_threads);

    // queue `work` (it may throw: the message goes to wait); returns the task's id. t_begin_ns: when begin started
    uint64_t submit(work_fn work, int64_t t_begin_ns);
    // record a task with nothing to compute as done (no thread wake-up), or as failed when error is not empty
    uint64_t complete(int64_t t_begin_ns, const std::string & error = "");

    struct times {
        int64_t begin_ns = 0;    // begin started
        int64_t returned_ns = 0; // the task was queued (begin returns right after)
        int64_t cpu_ns = 0;      // the worker's time on it
    };
    enum wait_result { DONE, FAILED, UNKNOWN };
    // block until task `id` has run; the task is forgotten after the n_waiters-th wait for it (a join's threads).
    // FAILED: its work threw (message in *error); UNKNOWN: no such task (never submitted, or already forgotten)
    wait_result wait(uint64_t id, int n_waiters, times * out, std::string * error);
    // tasks not yet forgotten
    size_t n_tasks();

  private:
    struct task {
        work_fn work;
        times t;
        bool done = false;
        std::string error;    // why it failed; empty: it did not
        int waiters_left = -1; // set by the first wait
    };
    uint64_t add(const std::shared_ptr<task> & t); // under mutex_

    void loop();

    std::mutex mutex_;         // the queue and the task records
    std::mutex compute_mutex_; // the backend: held while a task computes and while its thread count changes
    std::condition_variable wake_;
    std::condition_variable done_;
    std::deque<std::shared_ptr<task>> queue_;
    std::unordered_map<uint64_t, std::shared_ptr<task>> tasks_; // submitted, not yet waited for by every waiter
    uint64_t next_id_ = 1;
    ggml_backend_t backend_ = nullptr;
    bool stop_ = false;
    std::thread thread_;
};

// What a begin/join pair needs at compute time (the ops' userdata); one per layer and stage.
struct rapidmoe_overlap_site {
    const rapidmoe_layer_residual * layer = nullptr;
    int stage = RAPIDMOE_OVERLAP_GATE_UP;
    rapidmoe_residual_worker * worker = nullptr;
    rapidmoe_overlap_timing * timing = nullptr;
};

int64_t rapidmoe_overlap_now_ns();
// test entry: the next residual task the worker runs throws (rapidmoe_llama_worker_fail_next)
void rapidmoe_overlap_fail_next_task();

// begin: [n_ff, k, T, 2] (gate residual, up residual) of the critical slots of x [n_embd, 1|k, T]
ggml_tensor * rapidmoe_overlap_begin_gate_up(ggml_context * ctx, rapidmoe_overlap_site * site, ggml_tensor * x,
                                             ggml_tensor * crit_ids);
// join: [n_ff, k, T, 2] = (gate + gate residual, up + up residual)
ggml_tensor * rapidmoe_overlap_join_gate_up(ggml_context * ctx, rapidmoe_overlap_site * site, ggml_tensor * r,
                                            ggml_tensor * gate, ggml_tensor * up);
// begin: [n_embd, k, T] the critical slots' down of act [n_ff, k, T] (copy or residual; zeros elsewhere)
ggml_tensor * rapidmoe_overlap_begin_down(ggml_context * ctx, rapidmoe_overlap_site * site, ggml_tensor * act,
                                          ggml_tensor * crit_ids);
// join: [n_embd, k, T] critical slots from the copy (or WQ + residual), the others from WQ
ggml_tensor * rapidmoe_overlap_join_down(ggml_context * ctx, rapidmoe_overlap_site * site, ggml_tensor * r,
                                         ggml_tensor * experts, ggml_tensor * crit_ids);

// A layer with a per-expert WQ cache (rapidmoe-expert-cache.h): the worker also computes the misses' WQ from the
// stacked host tensors, so the device's cached experts, the CPU's misses and the CPU's residuals run at once:
//   begin(x, critical ids, miss ids, stacked gate, stacked up) -> R [n_ff, k, T, 4]: gate miss, up miss, gate WR,
//                                                                up WR (masked: zeros where a slot has no work)
//   ... the device: mul_mat_id(cache, x, slot ids) for gate and up (every slot; misses read slot 0) ...
//   join(R, gate dev, up dev, hit mask) -> [n_ff, k, T, 2] = (miss + dev * hit) + WR
// the same sums, in the same order, as the serial graph (cached WQ, then + residual): bit-equal results. The
// product dev * hit is taken as a select (hit is 0 or 1), so no fused multiply-add can change a rounding.
ggml_tensor * rapidmoe_overlap_begin_cached_gate_up(ggml_context * ctx, rapidmoe_overlap_site * site, ggml_tensor * x,
                                                    ggml_tensor * crit_ids, ggml_tensor * miss_ids,
                                                    ggml_tensor * gate_exps, ggml_tensor * up_exps);
ggml_tensor * rapidmoe_overlap_join_cached_gate_up(ggml_context * ctx, rapidmoe_overlap_site * site, ggml_tensor * r,
                                                   ggml_tensor * gate_dev, ggml_tensor * up_dev,
                                                   ggml_tensor * hit_mask);
// begin: [n_embd, k, T, 2] = down miss (stacked WQ), the critical slots' down (copy or residual)
ggml_tensor * rapidmoe_overlap_begin_cached_down(ggml_context * ctx, rapidmoe_overlap_site * site, ggml_tensor * act,
                                                 ggml_tensor * crit_ids, ggml_tensor * miss_ids,
                                                 ggml_tensor * down_exps);
// join: [n_embd, k, T]: wq = miss + dev * hit; critical slots R (a copy) or wq + R (a residual), the others wq
ggml_tensor * rapidmoe_overlap_join_cached_down(ggml_context * ctx, rapidmoe_overlap_site * site, ggml_tensor * r,
                                                ggml_tensor * down_dev, ggml_tensor * hit_mask,
                                                ggml_tensor * crit_ids);
