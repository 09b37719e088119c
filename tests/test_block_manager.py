"""Block manager and scheduler, driven with fake model outputs (no model, no torch)."""

from __future__ import annotations

import random

from llmserve.engine.block_hash import hash_block, namespace_hash
from llmserve.engine.block_manager import KVCacheManager
from llmserve.engine.request import Request, RequestStatus
from llmserve.engine.scheduler import Scheduler
from llmserve.sampling import SamplingParams


def req(rid: str, prompt: list[int], max_tokens: int = 8) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0), max_tokens)


def test_ref_counts_and_hash_chain():
    kv = KVCacheManager(num_blocks=10, block_size=4, namespace="m")
    a = req("a", list(range(10)))
    assert kv.allocate_slots(a, 10)
    assert kv.num_free_blocks == 9 - 3
    a.num_computed_tokens = 10
    full = kv.cache_full_blocks(a, 10)
    assert len(full) == 2  # tokens 0..7 form two full blocks; the third is partial
    h0 = hash_block(namespace_hash("m"), (0, 1, 2, 3))
    assert full[0].block_hash == h0 and full[1].block_hash == hash_block(h0, (4, 5, 6, 7))
    b = req("b", list(range(8)) + [99, 98])
    hits = kv.get_computed_blocks(b)
    assert [x.block_id for x in hits] == [x.block_id for x in full]
    assert kv.allocate_slots(b, 2, hits)
    assert [x.ref_cnt for x in full] == [2, 2]
    kv.free(a)
    assert [x.ref_cnt for x in full] == [1, 1]
    kv.free(b)
    assert kv.num_free_blocks == 9 and all(x.ref_cnt == 0 for x in full)
    # a freed block keeps its hash and is still a hit; another namespace never hits
    assert len(kv.get_computed_blocks(req("c", list(range(9))))) == 2
    other = KVCacheManager(num_blocks=10, block_size=4, namespace="other-model")
    assert other.root != kv.root


def test_hit_needs_equal_tokens_and_leaves_one_token():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", [1, 2, 3, 4, 5, 6, 7, 8])
    kv.allocate_slots(a, 8)
    kv.cache_full_blocks(a, 8)
    # the whole prompt is cached, but one token must still run to produce logits
    assert len(kv.get_computed_blocks(req("b", [1, 2, 3, 4, 5, 6, 7, 8]))) == 1
    block = kv.pool.cached[next(iter(kv.pool.cached))]
    block.token_ids = (9, 9, 9, 9)  # a hash whose tokens differ is not a hit
    assert kv.get_computed_blocks(req("c", [1, 2, 3, 4, 5, 6, 7, 8, 9])) == []


def test_eviction_is_lru_and_tail_first():
    kv = KVCacheManager(num_blocks=7, block_size=2)  # 6 usable blocks
    a, b = req("a", [1, 2, 3, 4]), req("b", [5, 6, 7, 8])
    for r in (a, b):
        kv.allocate_slots(r, 4)
        kv.cache_full_blocks(r, 4)
    kv.free(a)  # a's blocks queue first (tail block first), then b's
    kv.free(b)
    a_blocks = [blk for blk in kv.pool.blocks if blk.token_ids in ((1, 2), (3, 4))]
    c = req("c", [9, 9, 9, 9, 9, 9])
    kv.allocate_slots(c, 6)  # needs 3 blocks: 2 never-used, then a's tail block (3, 4)
    assert kv.pool.num_evictions == 1
    assert a_blocks[1].block_hash is None and a_blocks[0].block_hash is not None
    assert len(kv.get_computed_blocks(req("d", [5, 6, 7, 8, 0]))) == 2  # b untouched


def test_chunked_prefill_budget_and_decode_mixing():
    kv = KVCacheManager(num_blocks=200, block_size=4)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=16)
    s.add_request(req("short", [1, 2, 3], max_tokens=6))
    shapes = [drive_one(s)]
    s.add_request(req("long", list(range(50)), max_tokens=2))
    while s.has_unfinished():
        shapes.append(drive_one(s))
    assert all(p + d <= 16 for p, d in shapes)
    # while the long prompt is chunked, the short request keeps decoding in the same steps
    mixed = [(p, d) for p, d in shapes if p > 0 and d > 0]
    assert len(mixed) >= 3 and all(p == 15 for p, _ in mixed[:3])
    assert kv.num_free_blocks == 199


def drive_one(s: Scheduler) -> tuple[int, int]:
    out = s.schedule()
    s.advance(out)
    for x in out.scheduled:
        if x.samples:
            x.request.append_output_token(7)
            if len(x.request.output_token_ids) >= x.request.max_tokens:
                s.finish(x.request, RequestStatus.FINISHED_LENGTH)
    return out.num_prefill_tokens, out.num_decode_seqs


def test_max_num_seqs_and_fcfs():
    kv = KVCacheManager(num_blocks=200, block_size=4)
    s = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(4):
        s.add_request(req(f"r{i}", [i + 1] * 5, max_tokens=3))
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["r0", "r1"]


def test_preemption_and_no_leak_with_random_traffic():
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=24, block_size=4)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=32)
    reqs = [req(f"r{i}", [rng.randrange(50) for _ in range(rng.randint(3, 30))], max_tokens=rng.randint(1, 20)) for i in range(30)]
    for r in reqs:
        s.add_request(r)
    steps = 0
    while s.has_unfinished() and steps < 5000:
        out = s.schedule()
        s.advance(out)
        for x in out.scheduled:
            if x.samples:
                x.request.append_output_token(rng.randrange(50))
                if len(x.request.output_token_ids) >= x.request.max_tokens:
                    s.finish(x.request, RequestStatus.FINISHED_LENGTH)
        if steps % 7 == 3 and s.running:  # abort now and then
            s.finish(s.running[0], RequestStatus.FINISHED_ABORTED)
        steps += 1
    assert not s.has_unfinished()
    assert s.num_preemptions > 0
    assert kv.num_free_blocks == 23 and not kv.req_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert all(len(r.output_token_ids) == r.max_tokens for r in reqs if r.status is RequestStatus.FINISHED_LENGTH)


class ManualConnector:
    """A KV connector whose loads end when the test says, each with `hold` leading blocks found."""

    def __init__(self, hold: int):
        self.hold, self.started, self.ended = hold, {}, []

    def start_load(self, request_id, hashes, block_ids):
        assert request_id not in self.started  # asked once per request
        self.started[request_id] = (hashes, block_ids)

    def end(self, request_id):
        self.ended.append((request_id, min(self.hold, len(self.started[request_id][0]))))

    def finished_loads(self):
        out, self.ended = self.ended, []
        return out

    def store_block(self, block_id, block_hash):
        pass

    def wait(self, timeout_s):
        pass

    def close(self):
        pass


def test_a_loading_prefix_waits_off_the_loop_and_its_blocks_become_hits():
    """A request whose prefix the connector holds waits in WAITING_FOR_REMOTE_KVS while the others
    step; once the load ends, its loaded blocks are cached hits and it is admitted past them."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    kv.connector = ManualConnector(hold=2)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    short, long = req("short", [1, 2, 3], max_tokens=6), req("long", list(range(13)), max_tokens=2)
    s.add_request(short)  # no full block: nothing to ask
    s.add_request(long)  # 3 full blocks before its last token: asked for them
    for _ in range(3):
        drive_one(s)
    assert long.status is RequestStatus.WAITING_FOR_REMOTE_KVS and len(short.output_token_ids) == 3
    assert list(kv.connector.started) == ["long"] and len(kv.connector.started["long"][1]) == 3
    kv.connector.end("long")
    drive_one(s)
    assert long.status is RequestStatus.RUNNING and long.num_cached_tokens == 8
    while s.has_unfinished():
        drive_one(s)
    assert kv.num_free_blocks == 15 and all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_a_request_freed_while_loading_gets_its_blocks_back_when_the_load_ends():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    kv.connector = ManualConnector(hold=3)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    r = req("r", list(range(13)), max_tokens=2)
    s.add_request(r)
    drive_one(s)
    s.finish(r, RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == 12  # the connector may still be writing into its 3 blocks
    kv.connector.end("r")
    drive_one(s)
    assert kv.num_free_blocks == 15 and not kv.pool.cached and not s.has_unfinished()
