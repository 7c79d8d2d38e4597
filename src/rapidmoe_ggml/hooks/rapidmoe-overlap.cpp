// The residual worker and the begin/join ops that overlap the CPU's residual work with the device's WQ work
// (design in rapidmoe-overlap.h and docs/execution.md).
#include "rapidmoe-overlap.h"

#include "rapidmoe-residual.h"

#include "ggml-cpu.h"
#include "llama-impl.h" // LLAMA_LOG_ERROR

#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <vector>

int64_t rapidmoe_overlap_now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
}

// ---- worker ----------------------------------------------------------------------------------------------

rapidmoe_residual_worker::rapidmoe_residual_worker(int n_threads) {
    backend_ = ggml_backend_cpu_init();
    GGML_ASSERT(backend_ != nullptr);
    set_n_threads(n_threads);
    thread_ = std::thread([this] { loop(); });
}

rapidmoe_residual_worker::~rapidmoe_residual_worker() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stop_ = true; // the loop drains the queue first: a queued task writes into a live compute buffer
    }
    wake_.notify_all();
    thread_.join();
    ggml_backend_free(backend_);
}

void rapidmoe_residual_worker::set_n_threads(int n_threads) {
    std::lock_guard<std::mutex> lock(compute_mutex_); // not while a task computes on the backend
    ggml_backend_cpu_set_n_threads(backend_, n_threads < 1 ? 1 : n_threads);
}

uint64_t rapidmoe_residual_worker::add(const std::shared_ptr<task> & t) {
    t->t.returned_ns = rapidmoe_overlap_now_ns();
    const uint64_t id = next_id_++;
    tasks_[id] = t;
    return id;
}

uint64_t rapidmoe_residual_worker::submit(work_fn work, int64_t t_begin_ns) {
    auto t = std::make_shared<task>();
    t->work = std::move(work);
    t->t.begin_ns = t_begin_ns;
    uint64_t id = 0;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        id = add(t);
        queue_.push_back(t);
    }
    wake_.notify_one();
    return id;
}

uint64_t rapidmoe_residual_worker::complete(int64_t t_begin_ns, const std::string & error) {
    auto t = std::make_shared<task>();
    t->t.begin_ns = t_begin_ns;
    t->done = true;
    t->error = error;
    std::lock_guard<std::mutex> lock(mutex_);
    return add(t);
}

rapidmoe_residual_worker::wait_result rapidmoe_residual_worker::wait(uint64_t id, int n_waiters, times * out,
                                                                     std::string * error) {
    std::unique_lock<std::mutex> lock(mutex_);
    auto it = tasks_.find(id);
    if (it == tasks_.end()) {
        return UNKNOWN;
    }
    std::shared_ptr<task> t = it->second;
    if (t->waiters_left < 0) {
        t->waiters_left = n_waiters < 1 ? 1 : n_waiters;
    }
    if (--t->waiters_left == 0) {
        tasks_.erase(it); // the last of the join's threads: no later join can meet this task
    }
    done_.wait(lock, [&] { return t->done; });
    if (out != nullptr) {
        *out = t->t;
    }
    if (!t->error.empty()) {
        if (error != nullptr) {
            *error = t->error;
        }
        return FAILED;
    }
    return DONE;
}

size_t rapidmoe_residual_worker::n_tasks() {
    std::lock_guard<std::mutex> lock(mutex_);
    return tasks_.size();
}

void rapidmoe_residual_worker::loop() {
    for (;;) {
        std::shared_ptr<task> t;
        {
            std::unique_lock<std::mutex> lock(mutex_);
            wake_.wait(lock, [&] { return stop_ || !queue_.empty(); });
            if (queue_.empty()) {
                return; // stop_ and drained
            }
            t = queue_.front();
            queue_.pop_front();
        }
        int64_t t0 = 0, t1 = 0;
        std::string error;
        {
            std::lock_guard<std::mutex> lock(compute_mutex_);
            t0 = rapidmoe_overlap_now_ns();
            try { // an exception must reach the join, not end the process (std::terminate on this thread)
                t->work(backend_);
            } catch (const std::exception & e) {
                error = e.what()[0] != '\0' ? e.what() : "unknown error";
            } catch (...) {
                error = "unknown error";
            }
            t1 = rapidmoe_overlap_now_ns();
        }
        {
            std::lock_guard<std::mutex> lock(mutex_);
            t->t.cpu_ns = t1 - t0;
            t->error = std::move(error);
            t->done = true;
            t->work = nullptr; // frees the task's input copies now
        }
        done_.notify_all();
    }
}

// ---- the worker's graphs ---------------------------------------------------------------------------------

// test entry (rapidmoe_llama_worker_fail_next): the next residual task throws, as a failure inside the worker would
std::atomic<bool> g_fail_next{false};

void rapidmoe_overlap_fail_next_task() {
    g_fail_next = true;
}

namespace {

// A contiguous copy of a 3-d F32 or I32 tensor, taken in the begin op (the allocator may reuse the source
// as soon as begin returns).
std::vector<char> copy_3d(const ggml_tensor * t) {
    const size_t row = (size_t) t->ne[0] * ggml_type_size(t->type);
    std::vector<char> out(row * (size_t) (t->ne[1] * t->ne[2]));
    char * dst = out.data();
    for (int64_t i2 = 0; i2 < t->ne[2]; ++i2) {
        for (int64_t i1 = 0; i1 < t->ne[1]; ++i1) {
            std::memcpy(dst, (const char *) t->data + i1 * t->nb[1] + i2 * t->nb[2], row);
            dst += row;
        }
    }
    return out;
}

// The masked matmuls of one stage, computed on the worker's CPU backend straight into parts of begin's output:
// the critical slots' residuals, and in a cached layer also the misses' WQ from the stacked host tensors.
struct residual_job {
    struct matmul {
        ggml_tensor * w; // weights in CPU memory
        bool miss;       // ids: the misses' (true) or the critical slots' (false)
        char * out;      // a part of begin's output (allocated until join has read it)
    };
    int64_t in_ne[3];
    int64_t k, T;
    std::vector<char> in;   // the stage's input, contiguous F32
    std::vector<char> ids;  // critical ids [k, T], -1 elsewhere
    std::vector<char> miss; // miss ids [k, T], -1 on hits (cached layers only)
    std::vector<matmul> mms;

    void operator()(ggml_backend_t cpu) {
        if (g_fail_next.exchange(false)) {
            throw std::runtime_error("injected failure (rapidmoe_llama_worker_fail_next)");
        }
        constexpr size_t n_max = 16;
        ggml_init_params p = { n_max * ggml_tensor_overhead() + ggml_graph_overhead_custom(n_max, false), nullptr,
                               true };
        ggml_context * ctx = ggml_init(p);
        if (ctx == nullptr) {
            throw std::runtime_error("residual worker: cannot allocate its graph context");
        }
        ggml_tensor * x = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, in_ne[0], in_ne[1], in_ne[2]);
        x->data = in.data();
        ggml_tensor * id = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, k, T);
        id->data = ids.data();
        ggml_tensor * miss_id = nullptr;
        if (!miss.empty()) {
            miss_id = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, k, T);
            miss_id->data = miss.data();
        }
        ggml_cgraph * gf = ggml_new_graph_custom(ctx, n_max, false);
        for (const matmul & m : mms) {
            ggml_tensor * t = ggml_mul_mat_id_masked(ctx, m.w, x, m.miss ? miss_id : id);
            t->data = m.out;
            ggml_build_forward_expand(gf, t);
        }
        const ggml_status status = ggml_backend_graph_compute(cpu, gf);
        ggml_free(ctx);
        if (status != GGML_STATUS_SUCCESS) {
            throw std::runtime_error(std::string("residual worker: graph compute failed (") +
                                     ggml_status_to_string(status) + ")");
        }
    }
};

// The task id a begin leaves for its join: in the last 8 bytes of R's op_params (the custom op's own parameters,
// function, n_tasks and userdata, take the first 24). R is the same tensor for both: join's src[0] is begin's dst.
constexpr size_t TASK_ID_OFFSET = GGML_MAX_OP_PARAMS - sizeof(uint64_t);
static_assert(TASK_ID_OFFSET >= 3 * sizeof(void *), "op_params too small for the custom op and a task id");

void set_task_id(ggml_tensor * r, uint64_t id) {
    std::memcpy((char *) r->op_params + TASK_ID_OFFSET, &id, sizeof(id));
}

uint64_t task_id(const ggml_tensor * r) {
    uint64_t id = 0;
    std::memcpy(&id, (const char *) r->op_params + TASK_ID_OFFSET, sizeof(id));
    return id;
}

bool any_id(const ggml_tensor * ids) {
    for (int64_t t = 0; t < ids->ne[1]; ++t) {
        const auto * row = (const int32_t *) ((const char *) ids->data + t * ids->nb[1]);
        for (int64_t j = 0; j < ids->ne[0]; ++j) {
            if (row[j] >= 0) {
                return true;
            }
        }
    }
    return false;
}

// begin: dst->src = {input, critical ids} or, in a cached layer, {input, critical ids, miss ids, stacked WQ...}
// (gate and up, or down). Output parts (dst->nb[3] apart): the misses' WQ first (cached layers), then the
// residuals. A part with no slot to compute (no critical slot: r = 0 or UMIA's depth cutoff; no miss) is zeros.
void begin_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    const int64_t t0 = rapidmoe_overlap_now_ns();
    auto * site = (rapidmoe_overlap_site *) userdata;
    const ggml_tensor * in = dst->src[0];
    const ggml_tensor * ids = dst->src[1];
    const ggml_tensor * miss = dst->src[2]; // nullptr: not a cached layer
    const size_t part = dst->nb[3];
    std::vector<residual_job::matmul> mms;
    char * out = (char *) dst->data;
    if (miss != nullptr) {
        const bool any_miss = any_id(miss);
        for (int i = 3; i < GGML_MAX_SRC && dst->src[i] != nullptr; ++i, out += part) {
            if (any_miss) {
                mms.push_back({ dst->src[i], true, out });
            } else {
                std::memset(out, 0, part);
            }
        }
    }
    const rapidmoe_layer_residual * layer = site->layer;
    ggml_tensor * wr[2] = { site->stage == RAPIDMOE_OVERLAP_GATE_UP ? layer->gate_wr : layer->down_hi,
                            site->stage == RAPIDMOE_OVERLAP_GATE_UP ? layer->up_wr : nullptr };
    const bool any_crit = any_id(ids);
    for (ggml_tensor * w : wr) {
        if (w == nullptr) {
            continue;
        }
        if (any_crit) {
            mms.push_back({ w, false, out });
        } else {
            std::memset(out, 0, part);
        }
        out += part;
    }
    if (mms.empty()) { // nothing for the worker: zeros (written above), no thread woken
        set_task_id(dst, site->worker->complete(t0));
        return;
    }
    try { // on a compute thread: an exception (out of memory copying the inputs) must reach the join
        auto job = std::make_shared<residual_job>();
        job->in_ne[0] = in->ne[0];
        job->in_ne[1] = in->ne[1];
        job->in_ne[2] = in->ne[2];
        job->k = ids->ne[0];
        job->T = ids->ne[1];
        job->in = copy_3d(in);
        job->ids = copy_3d(ids);
        if (miss != nullptr) {
            job->miss = copy_3d(miss);
        }
        job->mms = std::move(mms);
        set_task_id(dst, site->worker->submit([job](ggml_backend_t cpu) { (*job)(cpu); }, t0));
    } catch (const std::exception & e) {
        set_task_id(dst, site->worker->complete(t0, std::string("residual begin: ") + e.what()));
    }
}

// Wait for the task of begin's output `r` (every thread: each combines its share after it); thread 0 records
// the stage's timing. False when the task failed: the error is recorded in the sidecar state and logged once.
bool join_wait(const rapidmoe_overlap_site * site, const ggml_tensor * r, int ith, int nth) {
    const int64_t t_enter = rapidmoe_overlap_now_ns();
    rapidmoe_residual_worker::times t;
    std::string error;
    const auto res = site->worker->wait(task_id(r), nth, &t, &error);
    if (res != rapidmoe_residual_worker::DONE) {
        if (ith == 0) {
            if (res == rapidmoe_residual_worker::UNKNOWN) {
                error = "join without its begin (no task " + std::to_string(task_id(r)) + ")";
            }
            rapidmoe_residual_state * st = site->layer->state;
            std::lock_guard<std::mutex> lock(st->error_mutex);
            if (st->worker_error.empty()) {
                LLAMA_LOG_ERROR("rapidmoe: layer %d: %s; its results are NaN\n", site->layer->il, error.c_str());
                st->worker_error = "layer " + std::to_string(site->layer->il) + ": " + error;
            }
        }
        return false;
    }
    if (ith == 0) {
        const int64_t t_done = rapidmoe_overlap_now_ns();
        rapidmoe_overlap_timing & tm = *site->timing;
        tm.n += 1;
        tm.cpu_ns += t.cpu_ns;
        tm.device_ns += t_enter - t.returned_ns;
        tm.wait_ns += t_done - t_enter;
        tm.wall_ns += t_done - t.begin_ns; // the combine after it is a few adds
    }
    return true;
}

inline const float * row_of(const ggml_tensor * t, int64_t i1, int64_t i2, int64_t i3 = 0) {
    return (const float *) ((const char *) t->data + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3]);
}

inline float * row_of(ggml_tensor * t, int64_t i1, int64_t i2, int64_t i3 = 0) {
    return (float *) ((char *) t->data + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3]);
}

// the serial graph's dev * hit (ggml_mul by a 0/1 mask: dev or a zero of dev's sign) as a select, so nothing is
// left for a compiler to fuse into a multiply-add
inline float masked(float dev, float hit) {
    return hit != 0.0f ? dev : std::copysign(0.0f, dev);
}

inline float hit_of(const ggml_tensor * hit_mask, int64_t i1, int64_t i2) {
    return *(const float *) ((const char *) hit_mask->data + i1 * hit_mask->nb[1] + i2 * hit_mask->nb[2]);
}

// The join of every stage and layer kind: dst [n, k, T, P] (P = 2: gate and up; P = 1: down) after waiting for the
// task of begin's output R. dst->src = {R, the device's WQ results (P of them), the hit mask (CACHED), the critical
// ids (DOWN)}; R's parts: the misses' WQ (CACHED: one per output part), then the residuals (one per output part).
//   wq  = CACHED ? miss + dev * hit : dev
//   out = DOWN ? (critical slots: R (a copy) or wq + R (a residual); the others: wq) : wq + R
// each the same sum, in the same order, as the serial graph's; NaN when the task failed.
template <bool CACHED, bool DOWN>
void join_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const auto * site = (const rapidmoe_overlap_site *) userdata;
    const ggml_tensor * r = dst->src[0];
    const int64_t parts = dst->ne[3];
    const ggml_tensor * hit = CACHED ? dst->src[1 + parts] : nullptr;
    const ggml_tensor * ids = DOWN ? dst->src[1 + parts + (CACHED ? 1 : 0)] : nullptr;
    const bool ok = join_wait(site, r, ith, nth);
    const bool copy = DOWN && site->layer->down_is_copy;
    const int64_t n = dst->ne[0], rows = dst->ne[1] * dst->ne[2];
    for (int64_t row = ith; row < parts * rows; row += nth) {
        const int64_t part = row / rows, i1 = (row % rows) % dst->ne[1], i2 = (row % rows) / dst->ne[1];
        const bool critical =
            !DOWN || *(const int32_t *) ((const char *) ids->data + i1 * ids->nb[0] + i2 * ids->nb[1]) >= 0;
        const float h = CACHED ? hit_of(hit, i1, i2) : 1.0f;
        const float * dev = row_of(dst->src[1 + part], i1, i2);
        const float * miss = CACHED ? row_of(r, i1, i2, part) : nullptr;
        const float * res = row_of(r, i1, i2, (CACHED ? parts : 0) + part);
        float * out = row_of(dst, i1, i2, part);
        for (int64_t i = 0; i < n; ++i) {
            const float wq = CACHED ? miss[i] + masked(dev[i], h) : dev[i];
            out[i] = !ok ? NAN : !critical ? wq : copy ? res[i] : wq + res[i];
        }
    }
}

// begin's node: [n, k, T, parts] for crit_ids [k, T]; args = {input, critical ids, ...} (see begin_op)
template <size_t N>
ggml_tensor * begin_node(ggml_context * ctx, rapidmoe_overlap_site * site, int64_t n, int64_t parts,
                         ggml_tensor * (&args)[N]) {
    const ggml_tensor * crit_ids = args[1];
    return ggml_custom_4d(ctx, GGML_TYPE_F32, n, crit_ids->ne[0], crit_ids->ne[1], parts, args, (int) N, begin_op, 1,
                          site);
}

// join's node: R's shape with `parts` output parts; args = {R, ...} (see join_op)
template <size_t N>
ggml_tensor * join_node(ggml_context * ctx, rapidmoe_overlap_site * site, int64_t parts, ggml_tensor * (&args)[N],
                        ggml_custom_op_t op) {
    const ggml_tensor * r = args[0];
    return ggml_custom_4d(ctx, GGML_TYPE_F32, r->ne[0], r->ne[1], r->ne[2], parts, args, (int) N, op, GGML_N_TASKS_MAX,
                          site);
}

}  // namespace

ggml_tensor * rapidmoe_overlap_begin_gate_up(ggml_context * ctx, rapidmoe_overlap_site * site, ggml_tensor * x,
                                             ggml_tensor * crit_ids) {
    ggml_tensor * args[2] = { x, crit_ids };
    return begin_node(ctx, site, site->layer->gate_wr->ne[1], 2, args);
}

ggml_tensor * rapidmoe_overlap_join_gate_up(ggml_context * ctx, rapidmoe_overlap_site * site, ggml_tensor * r,
                                            ggml_tensor * gate, ggml_tensor * up) {
    GGML_ASSERT(gate->type == GGML_TYPE_F32 && up->type == GGML_TYPE_F32);
    GGML_ASSERT(ggml_are_same_shape(gate, up) && gate->ne[0] == r->ne[0] && gate->ne[1] == r->ne[1] &&
                gate->ne[2] == r->ne[2]);
    ggml_tensor * args[3] = { r, gate, up };
    return join_node(ctx, site, 2, args, join_op<false, false>);
}

ggml_tensor * rapidmoe_overlap_begin_down(ggml_context * ctx, rapidmoe_overlap_site * site, ggml_tensor * act,
                                          ggml_tensor * crit_ids) {
    GGML_ASSERT(act->type == GGML_TYPE_F32);
    ggml_tensor * args[2] = { act, crit_ids };
    return begin_node(ctx, site, site->layer->down_hi->ne[1], 1, args);
}

ggml_tensor * rapidmoe_overlap_join_down(ggml_context * ctx, rapidmoe_overlap_site * site, ggml_tensor * r,
                                         ggml_tensor * experts, ggml_tensor * crit_ids) {
    GGML_ASSERT(experts->type == GGML_TYPE_F32 && ggml_are_same_shape(experts, r));
    ggml_tensor * args[3] = { r, experts, crit_ids };
    return join_node(ctx, site, 1, args, join_op<false, true>);
}

ggml_tensor * rapidmoe_overlap_begin_cached_gate_up(ggml_context * ctx, rapidmoe_overlap_site * site, ggml_tensor * x,
                                                    ggml_tensor * crit_ids, ggml_tensor * miss_ids,
                                                    ggml_tensor * gate_exps, ggml_tensor * up_exps) {
    GGML_ASSERT(ggml_are_same_shape(crit_ids, miss_ids) && gate_exps->ne[1] == site->layer->gate_wr->ne[1]);
    ggml_tensor * args[5] = { x, crit_ids, miss_ids, gate_exps, up_exps };
    return begin_node(ctx, site, site->layer->gate_wr->ne[1], 4, args);
}

ggml_tensor * rapidmoe_overlap_join_cached_gate_up(ggml_context * ctx, rapidmoe_overlap_site * site, ggml_tensor * r,
                                                   ggml_tensor * gate_dev, ggml_tensor * up_dev,
                                                   ggml_tensor * hit_mask) {
    GGML_ASSERT(gate_dev->type == GGML_TYPE_F32 && up_dev->type == GGML_TYPE_F32 && hit_mask->type == GGML_TYPE_F32);
    GGML_ASSERT(ggml_are_same_shape(gate_dev, up_dev) && gate_dev->ne[0] == r->ne[0] && gate_dev->ne[1] == r->ne[1] &&
                gate_dev->ne[2] == r->ne[2] && hit_mask->ne[1] == r->ne[1] && hit_mask->ne[2] == r->ne[2]);
    ggml_tensor * args[4] = { r, gate_dev, up_dev, hit_mask };
    return join_node(ctx, site, 2, args, join_op<true, false>);
}

ggml_tensor * rapidmoe_overlap_begin_cached_down(ggml_context * ctx, rapidmoe_overlap_site * site, ggml_tensor * act,
                                                 ggml_tensor * crit_ids, ggml_tensor * miss_ids,
                                                 ggml_tensor * down_exps) {
    GGML_ASSERT(act->type == GGML_TYPE_F32 && ggml_are_same_shape(crit_ids, miss_ids));
    ggml_tensor * args[4] = { act, crit_ids, miss_ids, down_exps };
    return begin_node(ctx, site, site->layer->down_hi->ne[1], 2, args);
}

ggml_tensor * rapidmoe_overlap_join_cached_down(ggml_context * ctx, rapidmoe_overlap_site * site, ggml_tensor * r,
                                                ggml_tensor * down_dev, ggml_tensor * hit_mask,
                                                ggml_tensor * crit_ids) {
    GGML_ASSERT(down_dev->type == GGML_TYPE_F32 && hit_mask->type == GGML_TYPE_F32);
    GGML_ASSERT(down_dev->ne[0] == r->ne[0] && down_dev->ne[1] == r->ne[1] && down_dev->ne[2] == r->ne[2]);
    ggml_tensor * args[4] = { r, down_dev, hit_mask, crit_ids };
    return join_node(ctx, site, 1, args, join_op<true, true>);
}
