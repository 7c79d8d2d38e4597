// Per-weight cost of ggml's CPU matmul kernels in a decode step (one activation row) and in a prompt batch (64
// rows), built and run against one build's ggml libraries by tools/kernel_cost.py (ours or stock llama.cpp's, to
// compare the two).
//
//   kernel_cost time THREADS TYPE...   for each shape below and TYPE (plain and, where the CPU has one, repacked
//                                      layout): wall time per node with the weights coming from memory (many
//                                      copies of the tensor, more bytes than the last-level cache; the routed
//                                      experts change every step), as ps per weight and GB/s; for the batches, ps
//                                      per multiply-add (weight x row)
//   kernel_cost check THREADS OUT TYPE...  the activations' Q8_K quantization of edge-case rows (its bytes), then
//                                      small deterministic matmuls; writes every output's raw floats to OUT
//                                      (the same inputs in every build: compare the files byte for byte) and
//                                      prints the matmuls it ran ("experts q2_K repacked": a layout the CPU has),
//                                      each with the count of values written so far (its end in OUT)
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

struct Shape {
    const char * name;
    int64_t n_in, n_out, n_as; // n_as = 0: a dense matmul
    int k;                     // routed experts per step
    int n_tok = 1;             // activation rows (tokens) per step
};

ggml_backend_buffer_type_t repack_buft() {
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    auto get_extra = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(
        ggml_backend_dev_backend_reg(cpu), "ggml_backend_dev_get_extra_bufts");
    for (auto * b = get_extra != nullptr ? get_extra(cpu) : nullptr; b != nullptr && *b != nullptr; ++b) {
        if (std::strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) {
            return *b;
        }
    }
    return nullptr;
}

ggml_type type_named(const char * name) {
    for (int t = 0; t < GGML_TYPE_COUNT; t++) {
        const char * n = ggml_type_name((ggml_type) t);
        if (n != nullptr && std::strcmp(n, name) == 0) {
            return (ggml_type) t;
        }
    }
    std::fprintf(stderr, "kernel_cost: unknown ggml type %s\n", name);
    std::exit(2);
}

// One measurement: `copies` weight tensors of one shape and type (in the plain or the repacked buffer), a graph
// with one matmul per copy. Returns false where the repacked buffer has no layout for the type and shape.
struct Bench {
    ggml_backend_t backend;
    std::mt19937 rng{ 1 };

    bool run(const Shape & sh, ggml_type type, bool repacked, int copies, int steps, double * s_per_node,
             std::vector<float> * out_values) {
        const int64_t n_as = std::max<int64_t>(sh.n_as, 1);
        rng.seed((uint32_t) (sh.n_in * 7919 + sh.n_out)); // the same inputs for a shape whatever ran before it
        ggml_init_params wp = { (size_t) (copies + 8) * ggml_tensor_overhead(), nullptr, true };
        ggml_context * cw = ggml_init(wp);
        std::vector<ggml_tensor *> ws(copies);
        for (auto & w : ws) {
            w = ggml_new_tensor_3d(cw, type, sh.n_in, sh.n_out, n_as);
        }
        ggml_backend_buffer_type_t buft = repacked ? repack_buft() : ggml_backend_cpu_buffer_type();
        ggml_backend_buffer_t bw = buft != nullptr ? ggml_backend_alloc_ctx_tensors_from_buft(cw, buft) : nullptr;
        ggml_tensor * x = ggml_new_tensor_3d(cw, GGML_TYPE_F32, sh.n_in, 1, sh.n_tok);
        ggml_tensor * x2 = ggml_new_tensor_2d(cw, GGML_TYPE_F32, sh.n_in, sh.n_tok);
        ggml_tensor * ids = ggml_new_tensor_2d(cw, GGML_TYPE_I32, std::max(sh.k, 1), sh.n_tok);
        ggml_backend_buffer_t bx = ggml_backend_alloc_ctx_tensors(cw, backend);
        ggml_tensor * probe = sh.n_as ? ggml_mul_mat_id(cw, ws[0], x, ids) : ggml_mul_mat(cw, ws[0], x2);
        if (bw == nullptr || (repacked && (ws[0]->extra == nullptr ||
                              !ggml_backend_dev_supports_op(ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU), probe)))) {
            if (bw != nullptr) {
                ggml_backend_buffer_free(bw);
            }
            ggml_backend_buffer_free(bx);
            ggml_free(cw);
            return false;
        }
        std::normal_distribution<float> nd(0.0f, 1.0f);
        const size_t expert_bytes = ggml_row_size(type, sh.n_in) * sh.n_out;
        std::vector<float> f(sh.n_in * sh.n_out);
        std::vector<uint8_t> q(expert_bytes * n_as);
        for (int64_t e = 0; e < n_as; e++) {
            for (auto & v : f) {
                v = nd(rng) * 0.02f;
            }
            ggml_quantize_chunk(type, f.data(), q.data() + e * expert_bytes, 0, sh.n_out, sh.n_in, nullptr);
        }
        for (auto * w : ws) { // the repacked buffer takes whole tensors only
            ggml_backend_tensor_set(w, q.data(), 0, q.size());
        }
        std::vector<float> xv(sh.n_in * sh.n_tok);
        for (auto & v : xv) {
            v = nd(rng);
        }
        ggml_backend_tensor_set(sh.n_as ? x : x2, xv.data(), 0, xv.size() * sizeof(float));
        const size_t k = std::max(sh.k, 1);
        std::vector<int32_t> idv(k * sh.n_tok);
        auto route = [&]() { // distinct experts per token, new every step (as routing gives)
            if (sh.n_as == 0) {
                return;
            }
            for (int t = 0; t < sh.n_tok; t++) {
                const auto tok = idv.begin() + t * k;
                for (size_t i = 0; i < k; i++) {
                    int32_t e;
                    do {
                        e = (int32_t) (rng() % sh.n_as);
                    } while (std::find(tok, tok + i, e) != tok + i);
                    tok[i] = e;
                }
            }
            ggml_backend_tensor_set(ids, idv.data(), 0, idv.size() * sizeof(int32_t));
        };
        route();
        ggml_init_params gp = { (size_t) (copies + 8) * ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true };
        ggml_context * cg = ggml_init(gp);
        ggml_cgraph * gf = ggml_new_graph(cg);
        std::vector<ggml_tensor *> outs;
        for (auto * w : ws) {
            outs.push_back(sh.n_as ? ggml_mul_mat_id(cg, w, x, ids) : ggml_mul_mat(cg, w, x2));
            ggml_build_forward_expand(gf, outs.back());
        }
        ggml_backend_buffer_t bo = ggml_backend_alloc_ctx_tensors(cg, backend);
        ggml_backend_graph_compute(backend, gf); // warm-up (and the check's values)
        if (out_values != nullptr) {
            for (auto * o : outs) {
                std::vector<float> v(ggml_nelements(o));
                ggml_backend_tensor_get(o, v.data(), 0, ggml_nbytes(o));
                out_values->insert(out_values->end(), v.begin(), v.end());
            }
        }
        double best = 1e30;
        for (int rep = 0; rep < 5 && steps > 0; rep++) {
            double total = 0;
            for (int i = 0; i < steps; i++) {
                route();
                const auto t0 = std::chrono::steady_clock::now();
                ggml_backend_graph_compute(backend, gf);
                total += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            }
            best = std::min(best, total / steps / copies);
        }
        *s_per_node = best;
        ggml_backend_buffer_free(bo);
        ggml_free(cg);
        ggml_backend_buffer_free(bw);
        ggml_backend_buffer_free(bx);
        ggml_free(cw);
        return true;
    }
};

// Rows of 256 values quantized by the CPU backend's Q8_K from_float (the activations of every K-quant matmul),
// their block bytes appended to out as floats' worth of bytes: random values, the largest magnitude reached with
// both signs (the first one sets the scale), a block of zeros, values that scale to exact halves (ties), a wide
// range of magnitudes
void quantize_q8_K_cases(std::vector<float> & out) {
    std::mt19937 rng(3);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const int n = 256;
    std::vector<float> rows;
    auto add = [&](auto value) {
        for (int j = 0; j < n; j++) {
            rows.push_back(value(j));
        }
    };
    for (int r = 0; r < 4; r++) {
        add([&](int) { return nd(rng); });
    }
    add([&](int j) { return j == 17 ? -3.0f : j == 200 ? 3.0f : nd(rng); });
    add([&](int j) { return j == 5 ? 3.0f : j == 9 ? -3.0f : nd(rng); });
    add([&](int) { return 0.0f; });
    add([&](int j) { return j == 0 ? -127.0f : (float) (j % 64) - 31.5f; }); // scale 1: every other value a tie
    add([&](int j) { return std::ldexp(nd(rng), (j % 40) - 20); });
    const ggml_from_float_t quantize = ggml_get_type_traits_cpu(GGML_TYPE_Q8_K)->from_float;
    const size_t row_bytes = ggml_row_size(GGML_TYPE_Q8_K, n);
    std::vector<uint8_t> q(rows.size() / n * row_bytes, 0);
    for (size_t r = 0; r < rows.size() / n; r++) {
        quantize(rows.data() + r * n, q.data() + r * row_bytes, n);
    }
    std::vector<float> as_floats((q.size() + sizeof(float) - 1) / sizeof(float), 0.0f);
    std::memcpy(as_floats.data(), q.data(), q.size());
    out.insert(out.end(), as_floats.begin(), as_floats.end());
}

}  // namespace

int main(int argc, char ** argv) {
    if (argc < 4 || (std::strcmp(argv[1], "time") != 0 && std::strcmp(argv[1], "check") != 0)) {
        std::fprintf(stderr, "usage: kernel_cost time THREADS TYPE... | kernel_cost check THREADS OUT TYPE...\n");
        return 2;
    }
    const bool check = std::strcmp(argv[1], "check") == 0;
    const int n_threads = std::atoi(argv[2]);
    const int first_type = check ? 4 : 3;
    ggml_cpu_init();
    Bench bench{ ggml_backend_cpu_init() };
    ggml_backend_cpu_set_n_threads(bench.backend, n_threads);
    // the 8.1 GB bench model's matmuls (qwen3moe: 64 experts, top-8), a decode step and a batch of 64 tokens
    const Shape timed[] = { { "gate/up", 1024, 768, 64, 8 },       { "down", 768, 1024, 64, 8 },
                            { "attn_q", 1024, 2048, 0, 0 },        { "head", 1024, 151936, 0, 0 },
                            { "gate/up x64", 1024, 768, 64, 8, 64 }, { "down x64", 768, 1024, 64, 8, 64 },
                            { "attn_q x64", 1024, 2048, 0, 0, 64 } };
    // decode, and batches whose experts get 4+ rows (the gemm, patch 0005) and whose dense rows are not a
    // multiple of 4 (the gemm, then the gemv for the rest)
    const Shape checked[] = { { "experts", 512, 64, 8, 4 },         { "dense", 768, 48, 0, 0 },
                              { "experts x16", 512, 64, 8, 4, 16 }, { "dense x18", 768, 48, 0, 0, 18 } };
    std::vector<float> values;
    if (check) { // the activations' quantization (Q8_K, patch 0009): its bytes, for vectors that test its edges
        quantize_q8_K_cases(values);
        std::printf("quantize q8_K %zu\n", values.size());
    }
    if (!check) {
        std::printf("| matmul | type | layout | us per node | ps per weight (x64: per weight x row) | GB/s |\n"
                    "|---|---|---|---|---|---|\n");
    }
    for (const Shape & sh : check ? std::vector<Shape>(std::begin(checked), std::end(checked))
                                  : std::vector<Shape>(std::begin(timed), std::end(timed))) {
        for (int a = first_type; a < argc; a++) {
            const ggml_type type = type_named(argv[a]);
            if (sh.n_in % ggml_blck_size(type) != 0) {
                continue;
            }
            for (bool repacked : { false, true }) {
                const double bytes = (double) ggml_row_size(type, sh.n_in) * sh.n_out * std::max<int64_t>(sh.n_as, 1);
                const int copies = check ? 1 : (int) std::clamp<double>(1.5e9 / bytes / std::sqrt(sh.n_tok), 1, 256);
                double s = 0;
                if (!bench.run(sh, type, repacked, copies, check ? 0 : std::max(20 / sh.n_tok, 2), &s,
                               check ? &values : nullptr)) {
                    continue;
                }
                if (check) {
                    std::printf("%s %s %s %zu\n", sh.name, argv[a], repacked ? "repacked" : "plain", values.size());
                } else {
                    const double weights = (double) sh.n_in * sh.n_out * std::max(sh.k, 1) * sh.n_tok;
                    std::printf("| %s | %s | %s | %.1f | %.1f | %.1f |\n", sh.name, argv[a], repacked ? "repacked" : "plain",
                                s * 1e6, s * 1e12 / weights,
                                weights / sh.n_tok * ggml_row_size(type, sh.n_in) / sh.n_in / s / 1e9);
                    std::fflush(stdout);
                }
            }
        }
    }
    if (check) {
        FILE * f = std::fopen(argv[3], "wb");
        if (f == nullptr || std::fwrite(values.data(), sizeof(float), values.size(), f) != values.size()) {
            std::fprintf(stderr, "kernel_cost: cannot write %s\n", argv[3]);
            return 1;
        }
        std::fclose(f);
    }
    ggml_backend_free(bench.backend);
    return 0;
}
