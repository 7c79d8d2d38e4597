// Decode and prefill at context depth through llama.h alone, with each depth's context filled or restored from a
// saved state: llama-bench's -d protocol (a tg and a pp test, each starting from the same depth's state, which
// llama-bench itself restores between repetitions with llama_state_seq_set_data), for depths whose fill at a slow
// engine's own speed would take longer than the measurement is worth.
//
// Built against any libllama of the pin (bench/bench_depth.py builds it against stock llama.cpp's and ours):
//   depth_state MODEL --kv f16|q8_0 --threads N --pp 512 --tg 16 --depths 0,4096,16384 [--save DIR] [--load DIR]
// One sweep in one process, depths in ascending order. At each depth D the context is DIR/<model>-<kv>-d<D>.state
// when --load DIR has it (checked: the restored cache must hold exactly D positions), else it is filled from the
// previous depth in --pp-token batches of random tokens (llama-bench's test_prompt); --save DIR writes it there.
// Then a pp test (one --pp batch) and a tg test (--tg single-token steps), each after restoring the depth's state.
// Prints one JSON line per depth: {"depth", "source": "fill"|"state", "fill_s", "pp", "tg"} (tok/s).
#include "llama.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <sys/stat.h>
#include <vector>

namespace {

struct Args {
    std::string model, kv = "f16", save_dir, load_dir;
    int threads = 2, pp = 512, tg = 16;
    std::vector<int> depths;
};

[[noreturn]] void die(const std::string & msg) {
    std::fprintf(stderr, "depth_state: %s\n", msg.c_str());
    std::exit(2);
}

Args parse(int argc, char ** argv) {
    Args a;
    for (int i = 1; i < argc; ++i) {
        const std::string k = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) die("missing value after " + k);
            return argv[++i];
        };
        if (k == "--kv") a.kv = value();
        else if (k == "--threads") a.threads = std::atoi(value().c_str());
        else if (k == "--pp") a.pp = std::atoi(value().c_str());
        else if (k == "--tg") a.tg = std::atoi(value().c_str());
        else if (k == "--save") a.save_dir = value();
        else if (k == "--load") a.load_dir = value();
        else if (k == "--depths") {
            std::stringstream ss(value());
            for (std::string d; std::getline(ss, d, ',');) a.depths.push_back(std::atoi(d.c_str()));
        } else if (a.model.empty() && k.rfind("--", 0) != 0) a.model = k;
        else die("unknown argument " + k);
    }
    if (a.model.empty() || a.depths.empty()) die("usage: depth_state MODEL --depths D,... [--kv f16|q8_0] "
                                                 "[--threads N] [--pp N] [--tg N] [--save DIR] [--load DIR]");
    if (a.kv != "f16" && a.kv != "q8_0") die("--kv must be f16 or q8_0, not " + a.kv);
    if (a.threads < 1 || a.pp < 1 || a.tg < 1) die("--threads, --pp and --tg must be positive");
    for (size_t i = 0; i < a.depths.size(); ++i) {
        if (a.depths[i] < 0 || a.depths[i] % a.pp != 0) die("depths must be non-negative multiples of --pp");
        if (i > 0 && a.depths[i] <= a.depths[i - 1]) die("depths must ascend");
    }
    return a;
}

double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Engine {
    llama_context * ctx;
    int n_vocab;
    llama_token bos;  // -1 when the vocabulary adds none
    std::mt19937 rng{42};

    llama_token random_token() { return static_cast<llama_token>(rng() % static_cast<unsigned>(n_vocab)); }

    // n tokens at positions pos..pos+n-1 of sequence 0, in one llama_decode; the first is BOS at position 0
    void decode(int n, llama_pos pos) {
        llama_batch batch = llama_batch_init(n, 0, 1);
        for (int i = 0; i < n; ++i) {
            batch.token[i] = (pos + i == 0 && bos >= 0) ? bos : random_token();
            batch.pos[i] = pos + i;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = i == n - 1;
        }
        batch.n_tokens = n;
        if (llama_decode(ctx, batch) != 0) die("llama_decode failed at position " + std::to_string(pos));
        llama_synchronize(ctx);
        llama_batch_free(batch);
    }

    llama_pos n_past() { return llama_memory_seq_pos_max(llama_get_memory(ctx), 0) + 1; }

    void restore(const std::vector<uint8_t> & state) {
        llama_memory_clear(llama_get_memory(ctx), true);
        if (!state.empty() && llama_state_seq_set_data(ctx, state.data(), state.size(), 0) == 0)
            die("llama_state_seq_set_data refused the depth's own state");
    }
};

std::string state_path(const std::string & dir, const Args & a, int depth) {
    std::string stem = a.model.substr(a.model.find_last_of('/') + 1);
    return dir + "/" + stem + "-" + a.kv + "-d" + std::to_string(depth) + ".state";
}

bool exists(const std::string & path) {
    struct stat st{};
    return stat(path.c_str(), &st) == 0;
}

}  // namespace

int main(int argc, char ** argv) {
    const Args a = parse(argc, argv);
    llama_backend_init();
    llama_log_set([](ggml_log_level level, const char * text, void *) {
        if (level >= GGML_LOG_LEVEL_WARN) std::fputs(text, stderr);
    }, nullptr);

    llama_model * model = llama_model_load_from_file(a.model.c_str(), llama_model_default_params());
    if (model == nullptr) die("cannot load " + a.model);
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = static_cast<uint32_t>(a.depths.back() + a.pp + a.tg + 16);
    cp.n_batch = cp.n_ubatch = static_cast<uint32_t>(a.pp);
    cp.n_threads = cp.n_threads_batch = a.threads;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    cp.type_k = cp.type_v = a.kv == "q8_0" ? GGML_TYPE_Q8_0 : GGML_TYPE_F16;
    cp.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (ctx == nullptr) die("cannot create a context of " + std::to_string(cp.n_ctx) + " cells");
    const llama_vocab * vocab = llama_model_get_vocab(model);
    Engine e{ctx, llama_vocab_n_tokens(vocab), llama_vocab_get_add_bos(vocab) ? llama_vocab_bos(vocab) : -1};

    e.decode(a.pp, 0);  // warm-up, as llama-bench's: one prompt batch and one step, then an empty cache
    e.decode(1, a.pp);
    e.restore({});

    for (int depth : a.depths) {
        const double t0 = now_s();
        std::string source = "fill";
        const std::string load = a.load_dir.empty() ? "" : state_path(a.load_dir, a, depth);
        if (depth > 0 && !load.empty() && exists(load)) {
            llama_memory_clear(llama_get_memory(ctx), true);
            size_t n_tokens = 0;
            if (llama_state_seq_load_file(ctx, load.c_str(), 0, nullptr, 0, &n_tokens) == 0)
                die("cannot read " + load);
            std::vector<llama_token> tokens(n_tokens + 1);
            if (llama_state_seq_load_file(ctx, load.c_str(), 0, tokens.data(), tokens.size(), &n_tokens) == 0)
                die(load + " does not fit this model and context (another model file or cache type?)");
            source = "state";
        } else {
            for (llama_pos n = e.n_past(); n < depth; n += a.pp) e.decode(a.pp, n);
        }
        if (e.n_past() != depth)
            die("the context holds " + std::to_string(e.n_past()) + " positions, not " + std::to_string(depth));
        const double fill_s = now_s() - t0;
        std::vector<uint8_t> state(depth > 0 ? llama_state_seq_get_size(ctx, 0) : 0);
        if (depth > 0) llama_state_seq_get_data(ctx, state.data(), state.size(), 0);
        if (!a.save_dir.empty() && depth > 0 && source == "fill") {
            const std::string path = state_path(a.save_dir, a, depth), tmp = path + ".tmp";
            if (llama_state_seq_save_file(ctx, tmp.c_str(), 0, nullptr, 0) == 0 || std::rename(tmp.c_str(), path.c_str()))
                die("cannot write " + path);
        }

        e.restore(state);
        double t = now_s();
        e.decode(a.pp, depth);
        const double pp = a.pp / (now_s() - t);

        e.restore(state);
        e.decode(1, depth);  // one untimed step, as llama-bench's generation warm-up
        e.restore(state);
        t = now_s();
        for (int i = 0; i < a.tg; ++i) e.decode(1, depth + i);
        const double tg = a.tg / (now_s() - t);

        e.restore(state);  // the next depth's fill goes on from this one
        std::printf("{\"depth\": %d, \"source\": \"%s\", \"fill_s\": %.1f, \"pp\": %.3f, \"tg\": %.3f}\n", depth,
                    source.c_str(), fill_s, pp, tg);
        std::fflush(stdout);
    }
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
