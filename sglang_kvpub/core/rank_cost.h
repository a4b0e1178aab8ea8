/* The rank cost in C: its one definition, included by both extensions (the engine's
 * sglang_kvpub/core/_native.c for dispatch_score, the router's motor_adapter/_answer.c for the
 * rank-aware answer).  sglang_kvpub/core/rank_cost.py is the reference; per rank:
 *
 *   matched = min(round((npu*w_npu + cpu*w_cpu + disk*w_disk) * block_size), isl)
 *   cost    = prefill_scale * max(0, isl - overlap_credit * matched) + load_weight * load
 *
 * tests/engine/test_rank_cost_native.py checks both agree on random inputs. */
#ifndef KVPUB_RANK_COST_H
#define KVPUB_RANK_COST_H

#include <math.h>

typedef struct {
    long long block_size;
    long long isl;
    double w_npu, w_cpu, w_disk;
    double prefill_scale, overlap_credit, load_weight;
} rank_cost_params;

/* Why a hit's matched tokens have no value: round() of NaN raises ValueError, of an infinity
 * or a value past a long long OverflowError. */
enum { RANK_COST_OK = 0, RANK_COST_NAN = 1, RANK_COST_RANGE = 2 };

/* The matched tokens of a hit of (npu, cpu, disk) blocks into *out: round() half to even, as
 * Python's round(), capped at isl.  RANK_COST_OK, or why there is no value. */
static inline int rank_cost_matched(const rank_cost_params *p, double npu, double cpu, double disk, long long *out) {
    const double weighted = npu * p->w_npu + cpu * p->w_cpu + disk * p->w_disk;
    const double tokens = nearbyint(weighted * (double)p->block_size);
    if (isnan(tokens)) return RANK_COST_NAN;
    if (isinf(tokens) || tokens < -9.2e18) return RANK_COST_RANGE;
    *out = tokens >= (double)p->isl ? p->isl : (long long)tokens;
    return RANK_COST_OK;
}

/* The prefill part of the cost for `matched` tokens of the prompt already cached. */
static inline double rank_cost_prefill(const rank_cost_params *p, long long matched) {
    const double rest = (double)p->isl - p->overlap_credit * (double)matched;
    return p->prefill_scale * (rest > 0.0 ? rest : 0.0);
}

/* A rank's cost: its prefill part and its load. */
static inline double rank_cost_of(const rank_cost_params *p, double prefill, double load) {
    return prefill + p->load_weight * load;
}

#endif
