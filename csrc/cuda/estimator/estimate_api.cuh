// Host-visible interface of the fused vertical-slash estimator (estimate_kernels.cuh,
// estimate.cu; bound to Python in estimate_binding.cpp). Plain C++ plus the CUDA runtime: raw
// pointers, sizes and a stream, no ATen.
//
// The estimator scores the last `lq` queries (global positions q_start .. q_start + lq - 1) of
// every query head against every local key, causally, in fp32 (bf16/fp16 tensor-core products):
//
//   pass A (run_row_stats): per row, the max logit and sum of exp(logit - max) over the local keys
//           (per-CTA partials over key splits, combined in a fixed order: deterministic);
//   pass B (run_masses):    p = exp(logit - row_max) / row_sum; the mass of each local key column
//           (sum over the rows of one query head) and of each global token diagonal
//           t = query position - key position (0 .. seq_len - 1), both divided by lq;
//   select (run_select):    per row of masses, the top-p entries (fewest, largest first, ties to the
//           lower index, whose cumulative mass reaches p * total; at least 1, at most cap), as a
//           fixed-width ascending list padded with kPad, and their count; up to two lists of rows
//           (each with its own p and cap) in the same launches;
//   documents (ScoreParams::documents): passes A and B over packed documents in the same
//           launches, each document's last min(lq, n) queries against its own n keys as a causal
//           sequence of its own; the columns land at the documents' keys, the token diagonals
//           are summed over a row's documents, each document's masses (divided by its rows)
//           weighted by its weight;
//   merge (run_merge):      the union of each row's selected columns and its batch row's extra
//           columns (the documents' sinks), ascending without repeats, kPad padded;
//   finalize (run_finalize): selected token diagonals -> block diagonals (t / block and, unless
//           t % block == 0, the next one) plus the local ones; selected columns plus the sink
//           tokens, less the columns in the last `leading run` blocks (SparseIndex.from_blocks).
//
// Local key kk of rank `rank` in a group of `world` striped ranks sits at global position
// ((kk / block) * world + rank) * block + kk % block (block a multiple of 64;
// mtraining::stripe_global_token in pattern.h).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "mtraining/pattern.h"

namespace mtr {
namespace est {

enum class Elem { kBF16, kFP16 };

constexpr int kPad = mtraining::kListPad;  // list padding of SparseIndex
constexpr int kTile = 64;         // keys per tile, query rows per chunk
constexpr int kMaxChunks = 4;     // lq <= 256
constexpr int kDiagSlots = 128;   // per (chunk, key tile): its 127 token diagonals, one spare
constexpr int kMaxSelectLen = (1 << 22) - 1;  // the packed histogram counts 22 bits
constexpr int kSelectChunk = 8192;  // mass entries per select CTA
constexpr int kSelectLevels = 4;    // 8-bit radix digits of the float bits

// One packed document of a document-mode score pass (ScoreParams::documents), set by the host.
struct ScoreDocument {
    int cta_first;  // its first CTA: documents are in launch order, each with heads * splits CTAs
    int row;        // batch row
    int q_row;      // the row of q holding its first scored query (position key_first + length - lq)
    int key_first;  // position of its first key in the row
    int length;     // n: its keys, token diagonals 0 .. n - 1
    int lq, chunks, num_tiles, splits, tiles_per_split;
    float weight;             // its masses' weight (each already divided by its lq rows)
    long long stats_first;    // its first row of part_max / row_max: earlier documents' heads * lq
    long long partial_first;  // its first diag_partials float
};

struct ScoreParams {
    const void* q = nullptr;  // [batch, lq, heads, head_dim]: rows at q_row_stride, batches at q_batch_stride
    const void* k = nullptr;  // [batch, sk, kv_heads, head_dim]
    long long q_batch_stride = 0, q_row_stride = 0;  // elements
    long long k_batch_stride = 0, k_row_stride = 0;
    int batch = 0, heads = 0, kv_heads = 0, head_dim = 0;
    int lq = 0;        // query rows (1 .. 64 * kMaxChunks)
    int chunks = 0;    // ceil(lq / 64)
    int sk = 0;        // local keys
    int q_start = 0;   // global position of query row 0
    int seq_len = 0;   // global sequence length (token diagonals 0 .. seq_len - 1)
    int world = 1, rank = 0, block = 64;
    float scale = 1.f;
    int num_tiles = 0;        // ceil(sk / 64)
    int splits = 0;           // key splits per head (CTAs per head)
    int tiles_per_split = 0;  // num_tiles <= splits * tiles_per_split, every split non-empty
    // pass A
    float* part_max = nullptr;  // [batch, heads, lq, splits]
    float* part_sum = nullptr;
    float* row_max = nullptr;   // [batch, heads, lq] (pass A writes, pass B reads)
    float* row_sum = nullptr;   // sum of exp(logit - row_max)
    // pass B
    float* columns = nullptr;        // [batch, heads, sk]
    float* diag_partials = nullptr;  // [batch, heads, chunks, num_tiles, kDiagSlots]
    float* diagonals = nullptr;      // [batch, heads, seq_len]
    // layout of the outputs (one sequence: stats_rows = batch * heads * lq, split_stride = splits,
    // columns_stride = sk, weight 1)
    long long stats_rows = 0;      // rows of row_max / row_sum
    int split_stride = 0;          // entries per row of part_max / part_sum (>= splits)
    long long columns_stride = 0;  // floats between consecutive (batch, head) rows of columns
    float weight = 1.f;            // factor of the column masses
    // document mode (documents != nullptr): the fields above lq .. tiles_per_split are each
    // CTA's document's (the kernels read a view of it), chunks is the largest document's (shared
    // memory), seq_len is the row length (diagonals), columns [batch, heads, seq_len]
    const ScoreDocument* documents = nullptr;  // [num_documents], on the device
    int num_documents = 0;
    int document_ctas = 0;                // the grid: heads * the sum of the documents' splits
    const int* row_documents = nullptr;  // each row's documents, longest first, rows in order
    const int* row_first = nullptr;      // [batch + 1]: row b's are row_documents[row_first[b] ..]
};

// One list of mass rows to select from.
struct SelectSegment {
    const float* mass = nullptr;  // [rows, n] at row_stride, non-negative (masses summing to ~1)
    long long row_stride = 0;
    int rows = 0, n = 0;
    float p = 1.f;
    int cap = 1;                  // >= 1
    int width = 0;                // min(cap, n): the fixed list width
    int* indices = nullptr;       // [rows, width] ascending, kPad padded
    int* count = nullptr;         // [rows]
};

// One or two segments (vertical and slash masses) selected in the same launches.
struct SelectParams {
    SelectSegment segment[2];
    int segments = 1;
    void* scratch = nullptr;  // select_scratch_bytes(rows of all segments, longest n), 16-byte aligned
    // set by run_select from the above
    int total_rows = 0, max_chunks = 0;
    unsigned long long* histogram = nullptr;  // [kSelectLevels][total_rows][256], zeroed by run_select
    void* states = nullptr;                   // [kSelectLevels - 1][total_rows] per-row search states
    uint32_t* records = nullptr;              // [total_rows][max_chunks][1 + 256] per-chunk counts
};

struct MergeParams {
    const int* selected = nullptr;        // [rows, selected_width] ascending, the first selected_count[row] read
    const int* selected_count = nullptr;  // [rows]
    int selected_width = 0;
    const int* extra = nullptr;  // [rows / heads, extra_width] ascending, kPad padded (one list per batch row)
    int extra_width = 0;
    int rows = 0, heads = 1;
    int* merged = nullptr;  // [rows, selected_width + extra_width] ascending without repeats, kPad padded
    int* merged_count = nullptr;
};

struct FinalizeParams {
    const int* slash_tokens = nullptr;  // [rows, slash_token_width] token diagonals (any order; < 0 or >= seq_len: ignored)
    const int* slash_token_count = nullptr;  // [rows]: entries to read
    int slash_token_width = 0;
    const int* columns = nullptr;  // [rows, column_width] ascending key positions in [0, seq_len)
    const int* column_count = nullptr;
    int column_width = 0;
    int rows = 0, seq_len = 0, block = 64, num_blocks = 0, local_blocks = 1, sink_tokens = 0;
    int* slash = nullptr;  // [rows, slash_width] ascending block diagonals, kPad padded
    int* slash_count = nullptr;
    int slash_width = 0;   // >= min(num_blocks, local_blocks + 2 * slash_token_width)
    int* vertical = nullptr;  // [rows, vertical_width] ascending key positions, kPad padded
    int* vertical_count = nullptr;
    int vertical_width = 0;   // >= min(sink_tokens, seq_len) + column_width
};

// Dynamic shared memory of the score kernels (``chunks`` query chunks of 64 rows, pass B with
// masses = true) and of the select kernel, for the launches and the binding's checks.
int score_smem_bytes(int head_dim, int chunks, bool masses);
int select_smem_bytes();
// Scratch of run_select for `rows` rows (all segments) of at most `n` entries.
long long select_scratch_bytes(int rows, int n);

cudaError_t run_row_stats(const ScoreParams& p, Elem elem, cudaStream_t stream);
cudaError_t run_masses(const ScoreParams& p, Elem elem, cudaStream_t stream);
cudaError_t run_select(const SelectParams& p, cudaStream_t stream);
cudaError_t run_merge(const MergeParams& p, cudaStream_t stream);
cudaError_t run_finalize(const FinalizeParams& p, cudaStream_t stream);

}  // namespace est
}  // namespace mtr
