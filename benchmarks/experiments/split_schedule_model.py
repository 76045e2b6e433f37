"""A model of the split schedule's barrier protocol (``backward_gluon._consume_tile_split``),
run under random interleavings: two programs (a head-block pair's leader and follower,
each with unpaired tiles before and after the pair's tile, so their tiles start at
different block parities), each a producer and two consumers, mbarriers with parity waits,
the deterministic mode's per-parity flags and the leader's pacing. It checks that no
interleaving deadlocks and that every read sees the block it should (kv rows for S and dQ,
P and dS for dQ and dKV, the leader's rows before the follower adds to them), with one
P/dS buffer (``split=1``) or two (``split=2``); and that the check catches three broken
variants (per-consumer flags, no follower wait, pacing one block too far). With
``early`` (``backward_gluon.QD_EARLY``: the last block's owner releases q's and dO's first
2 or 3 D quarters once its dKV pieces are done with them, and the producer loads the next
tile's quarters into them) it checks that no quarter is replaced while a consumer still
reads it, and that the check catches a release at every owned block. With ``dq``
(``backward_gluon.DQ_TMA``: each consumer stages its dQ half in its q quarters for a TMA
store at the tile's end, after waiting for the last block's P/dS barrier) it checks that
no staged dQ is read as q and none is overwritten before the TMA has read it, and that the
check catches the staging without the wait. (Staging in the kv buffer, an option measured
slower and removed, was modelled here too: its first form counted the staging barrier's
phases over all tiles, and consumers can finish a tile without blocks before the producer
reaches that wait, so the phase aliased: a deadlock in 6% of the interleavings.)

    python benchmarks/experiments/split_schedule_model.py     # prints the counts, exits 1 on failure

A design check of the protocol as written down here, not of the kernel: the GPU tests
(tests/test_kernels_gpu.py) run the kernel.
"""
import random
import sys


class Bar:
    """An mbarrier: ``count`` arrivals complete a phase; wait(p) passes once phase parity p
    has completed (a fresh barrier counts phase 1 as complete)."""

    def __init__(self, count):
        self.count, self.pending, self.done = count, 0, 0

    def arrive(self):
        self.pending += 1
        if self.pending == self.count:
            self.pending, self.done = 0, self.done + 1

    def ok(self, parity):
        return (self.done & 1) != parity


def program(role, nbs, split, shared, pair_tile, bug, early=0, dq=0):
    bars = dict(QD_READY=Bar(1), QD_FREE=Bar(2), KV_READY0=Bar(1), KV_READY1=Bar(1), KV_FREE0=Bar(1),
                KV_FREE1=Bar(1), PDS_READY=Bar(1), PDS_FREE=Bar(2), R0=Bar(1), R1=Bar(1), F0=Bar(2),
                F1=Bar(2), QD_FREE_EARLY=Bar(2))
    st = dict(q=[None] * 4, kv=[None, None], p=[None, None])  # q: the tile in each D quarter
    g0s, g = [], 0
    for n in nbs:
        g0s.append(g)
        g += n

    def producer():
        for t, n in enumerate(nbs):
            if early:  # the first quarters as soon as they are released (the earliest a load lands)
                yield ("QD_FREE_EARLY", (t & 1) ^ 1)
                st["q"][:early] = [t] * early
            yield ("QD_FREE", (t & 1) ^ 1)
            st["q"][early:] = [t] * (4 - early)
            bars["QD_READY"].arrive()
            for j in range(n):
                g = g0s[t] + j
                for h in range(2):
                    yield (f"KV_FREE{h}", (g & 1) ^ 1)
                    st["kv"][h] = g
                    bars[f"KV_READY{h}"].arrive()

    def stage(wg, t):  # my dQ half into two quarters of q
        st["q"][2 * wg:2 * wg + 2] = [("dq", t)] * 2

    def tma_read(wg, t):  # the TMA reads what was staged
        staged = st["q"][2 * wg:2 * wg + 2]
        assert all(x == ("dq", t) for x in staged), ("dQ overwritten before the TMA read it", t, st)

    def consumer(wg):
        fl, dn, rows = shared["flag"], shared["done"], shared["rows"]
        for t, n in enumerate(nbs):
            yield ("QD_READY", t & 1)
            for j in range(n):
                g = g0s[t] + j
                mine = g % 2 == wg
                if split == 2:
                    pb, pph, ready, free = g & 1, (g >> 1) & 1, f"R{g & 1}", f"F{g & 1}"
                else:
                    pb, pph, ready, free = 0, g & 1, "PDS_READY", "PDS_FREE"
                if mine:  # S and dP read both kv halves and q
                    yield ("KV_READY0", g & 1)
                    yield ("KV_READY1", g & 1)
                    assert st["kv"] == [g, g] and st["q"] == [t] * 4, ("S", g, st)
                    yield ("step",)
                    yield (free, pph ^ 1)
                    st["p"][pb] = g
                    bars[ready].arrive()
                yield (ready, pph)
                assert st["p"][pb] == g and st["kv"][wg] == g, ("dQ", g, st)
                yield ("step",)
                bars[f"KV_FREE{wg}"].arrive()
                if mine:
                    paired = t == pair_tile
                    cls = wg if bug == "per-consumer flags" else j % 2
                    if paired and role == "follower" and bug != "no follower wait":
                        yield ("spin", lambda: fl[cls] > j // 2)
                    if paired and role == "leader" and j >= 1:
                        back = j - 1
                        extra = 1 if bug == "pacing too far" else 0
                        yield ("spin", lambda: dn[back % 2] > back // 2 + extra)
                    for c in range(4):  # the dKV pieces read P, dS and q's and dO's quarters in order
                        yield ("step",)
                        assert st["p"][pb] == g and st["q"][c] == t, ("dKV", g, c, st)
                        if early and c == early - 1 and (j == n - 1 or bug == "early every block"):
                            bars["QD_FREE_EARLY"].arrive()
                    bars[free].arrive()
                    if paired and role == "leader":
                        rows[j] = "stored"
                        yield ("step",)
                        fl[cls] += 1
                    elif paired:
                        assert rows[j] == "stored", ("the follower adds before the leader stored", j)
                        rows[j] = "added"
                        dn[j % 2] += 1
                else:
                    bars[free].arrive()
            if early and (n == 0 or (g0s[t] + n - 1) % 2 != wg):  # not the last block's owner
                bars["QD_FREE_EARLY"].arrive()
            if dq == 1:  # through my q quarters, once the last block's owner has read them
                last = g0s[t] + n - 1
                if n > 0 and bug != "dq no wait":
                    if split == 2:
                        yield (f"F{last & 1}", (last >> 1) & 1)
                    else:
                        yield ("PDS_FREE", last & 1)
                stage(wg, t)
                yield ("step",)
                tma_read(wg, t)
            bars["QD_FREE"].arrive()

    def ready(w):
        if w[0] == "step":
            return True
        if w[0] == "spin":
            return w[1]()
        return bars[w[0]].ok(w[1])

    return [producer(), consumer(0), consumer(1)], ready


def run(seed, split, bug=None, early=0, dq=0):
    rnd = random.Random(seed)
    n_pair = rnd.randint(1, 7)
    tiles = [[rnd.randint(0, 5) for _ in range(rnd.randint(0, 2))] for _ in range(2)]
    after = [[rnd.randint(0, 5) for _ in range(rnd.randint(0, 1))] for _ in range(2)]
    shared = dict(flag=[0, 0], done=[0, 0], rows=[None] * n_pair)
    agents, ready = [], []
    for role, pre, post in zip(("leader", "follower"), tiles, after):
        a, r = program(role, pre + [n_pair] + post, split, shared, len(pre), bug, early, dq)
        agents += a
        ready += [r] * 3
    waiting, alive = [None] * 6, [True] * 6
    while any(alive):
        runnable = [i for i in range(6) if alive[i] and (waiting[i] is None or ready[i](waiting[i]))]
        if not runnable:
            return "deadlock"
        i = rnd.choice(runnable)
        try:
            waiting[i] = next(agents[i])
        except StopIteration:
            alive[i] = False
    return "ok" if all(r == "added" for r in shared["rows"]) else "rows not added"


def failures(split, bug=None, seeds=3000, early=0, dq=0):
    out = 0
    for seed in range(seeds):
        try:
            out += run(seed, split, bug, early, dq) != "ok"
        except AssertionError:
            out += 1
    return out


if __name__ == "__main__":
    good = {(split, early, 0): failures(split, early=early) for split in (1, 2) for early in (0, 2, 3)}
    good.update({(split, 0, 1): failures(split, dq=1) for split in (1, 2)})
    bugs = ("per-consumer flags", "no follower wait", "pacing too far")
    caught = {bug: failures(1, bug, 500) for bug in bugs}
    caught["early every block"] = failures(2, "early every block", 500, early=2)
    caught["dq no wait"] = failures(2, "dq no wait", 500, dq=1)
    print("interleavings failing of 3000, (split, early quarters, dQ by TMA):", good)
    print("broken variants, interleavings failing of 500:", caught)
    sys.exit(0 if not any(good.values()) and all(caught.values()) else 1)
