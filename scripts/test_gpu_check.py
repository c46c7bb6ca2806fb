#!/usr/bin/env python3
"""Tests of scripts/gpu_check.py on made-up inputs: each comparison passes on a good input and
fails on a doctored one (a parity file off by 1e-3, an NCCL loss file off by 1e-4, a GEMM whose
output differs, a trace with no interleaving). Run: python3 scripts/test_gpu_check.py
(CI and scripts/gpu-check.sh run it; standard library only)."""

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_check as g  # noqa: E402


def quiet(f, *args):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        status = f(*args)
    return status, out.getvalue()


class Files:
    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="gpu-check-test-")

    def path(self, name, text):
        p = os.path.join(self.dir, name)
        with open(p, "w") as f:
            f.write(text)
        return p

    def losses(self, name, values):
        return self.path(name, "step,loss\n" + "".join(f"{i},{v!r}\n" for i, v in enumerate(values)))

    def close(self):
        shutil.rmtree(self.dir)


REF = [5.545, 5.31, 5.02, 4.77, 4.51, 4.32, 4.2, 4.05]


class Losses(unittest.TestCase):
    def setUp(self):
        self.f = Files()

    def tearDown(self):
        self.f.close()

    def test_a_parity_file_off_by_1e3_fails_the_cpu_cuda_parity(self):
        ref = self.f.losses("ref.csv", REF)
        close = self.f.losses("close.csv", [v * (1 + 2e-5) for v in REF])
        self.assertEqual(quiet(g.compare_losses, "parity", close, ref, 3e-4)[0], g.PASS)
        off = self.f.losses("off.csv", REF[:5] + [REF[5] * (1 + 1e-3)] + REF[6:])
        status, out = quiet(g.compare_losses, "parity", off, ref, 3e-4)
        self.assertEqual(status, g.FAIL)
        self.assertIn("at step 5", out)

    def test_an_nccl_file_off_by_1e4_fails_at_1e5(self):
        ref = self.f.losses("staged.csv", REF)
        same = self.f.losses("same.csv", REF)
        self.assertEqual(quiet(g.compare_losses, "nccl", same, ref, 1e-5)[0], g.PASS)
        off = self.f.losses("nccl.csv", [v * (1 + 1e-4) if i == 7 else v for i, v in enumerate(REF)])
        self.assertEqual(quiet(g.compare_losses, "nccl", off, ref, 1e-5)[0], g.FAIL)

    def test_missing_steps_a_nan_or_a_missing_file_fail(self):
        ref = self.f.losses("ref.csv", REF)
        self.assertEqual(quiet(g.compare_losses, "x", self.f.losses("short.csv", REF[:-1]), ref, 1)[0], g.FAIL)
        nan = self.f.losses("nan.csv", REF[:3] + [float("nan")] + REF[4:])
        self.assertEqual(quiet(g.compare_losses, "x", nan, ref, 1)[0], g.FAIL)
        self.assertEqual(quiet(g.compare_losses, "x", os.path.join(self.f.dir, "none.csv"), ref, 1)[0], g.FAIL)


def trace(buckets, backward):
    """A trace of rank 0: bucket collectives and backward spans as (start_us, end_us)."""
    ev = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "rank 0"}}]
    for i, (s, e) in enumerate(backward):
        ev.append({"ph": "X", "cat": "compute", "pid": 0, "tid": 0, "ts": s, "dur": e - s,
                   "name": f"backward blocks.{i}", "args": {"kind": {"Backward": {"scope": f"blocks.{i}"}}}})
    for i, (s, e) in enumerate(buckets):
        ev.append({"ph": "X", "cat": "comm", "pid": 0, "tid": 1, "ts": s, "dur": e - s,
                   "name": f"all_reduce `bucket{i}`",
                   "args": {"op": "all_reduce", "tag": f"bucket{i}", "kind": {"Collective": {"bucket": i}}}})
    # a ready marker and another rank's overlap do not count
    ev.append({"ph": "X", "cat": "comm", "pid": 0, "tid": 1, "ts": 0, "dur": 0, "name": "ready",
               "args": {"op": "ready", "tag": "bucket0 ready", "kind": {"Collective": {"bucket": None}}}})
    return {"traceEvents": ev}


class Overlap(unittest.TestCase):
    def setUp(self):
        self.f = Files()

    def tearDown(self):
        self.f.close()

    def test_interleaved_buckets_pass_and_a_trace_with_no_interleaving_fails(self):
        backward = [(0, 100), (100, 200), (200, 300)]
        good = self.f.path("good.json", json.dumps(trace([(120, 260), (300, 400)], backward)))
        status, out = quiet(g.check_overlap, "overlap", good)
        self.assertEqual(status, g.PASS, out)
        self.assertIn("1 of 2 bucket collectives", out)
        after = self.f.path("after.json", json.dumps(trace([(300, 380), (380, 460)], backward)))
        self.assertEqual(quiet(g.check_overlap, "overlap", after)[0], g.FAIL)
        none = self.f.path("none.json", json.dumps(trace([], backward)))
        self.assertEqual(quiet(g.check_overlap, "overlap", none)[0], g.FAIL)


class Numbers(unittest.TestCase):
    def setUp(self):
        self.f = Files()

    def tearDown(self):
        self.f.close()

    def bench(self, rows):
        return self.f.path("gemm.json", json.dumps(rows))

    def row(self, dtype, ratio, equal=True):
        return {"dtype": dtype, "ratio": ratio, "outputs_equal": equal, "mismatches": 0 if equal else 1,
                "worst_abs_diff": 0.0 if equal else 0.5, "worst_index": 4097, "brigade_tflops": 40,
                "cublas_tflops": 41}

    def test_gemm_passes_fast_and_equal_misses_slow_and_fails_on_one_wrong_element(self):
        self.assertEqual(quiet(g.check_gemm, "gemm", self.bench([self.row("f32", 0.97), self.row("bf16", 1.0)]),
                               0.95)[0], g.PASS)
        self.assertEqual(quiet(g.check_gemm, "gemm", self.bench([self.row("f32", 0.8), self.row("bf16", 1.0)]),
                               0.95)[0], g.MISS)
        status, out = quiet(g.check_gemm, "gemm", self.bench([self.row("f32", 1.2, equal=False),
                                                              self.row("bf16", 1.0)]), 0.95)
        self.assertEqual(status, g.FAIL)
        self.assertIn("differs", out)

    def test_the_gpt_step_against_pytorch(self):
        log = self.f.path("step.log", 'warming up\n{"median_step_ms": 21.0, "last_loss": 4.2}\n')
        fast = self.f.path("torch.json", json.dumps({"torch_gpt_step": {"s": 0.020}}))
        self.assertEqual(quiet(g.check_step, "step", log, fast, 1.1)[0], g.PASS)
        slow = self.f.path("torch2.json", json.dumps({"torch_gpt_step": {"s": 0.015}}))
        self.assertEqual(quiet(g.check_step, "step", log, slow, 1.1)[0], g.MISS)
        broken = self.f.path("torch3.json", json.dumps({"torch_gpt_step": {"error": "ImportError"}}))
        self.assertEqual(quiet(g.check_step, "step", log, broken, 1.1)[0], g.MISS)
        nolog = self.f.path("nolog.log", "error: out of memory\n")
        self.assertEqual(quiet(g.check_step, "step", nolog, fast, 1.1)[0], g.FAIL)
        # the bf16 step reads PyTorch's autocast entry, not the f32 one
        both = self.f.path("torch4.json", json.dumps({"torch_gpt_step": {"s": 0.020}, "torch_gpt_step_bf16": {"s": 0.010}}))
        self.assertEqual(quiet(g.check_step, "step", log, both, 1.1)[0], g.PASS)
        self.assertEqual(quiet(g.check_step, "step", log, both, 1.1, "torch_gpt_step_bf16")[0], g.MISS)

    def test_prediction_within_a_quarter_passes(self):
        log = self.f.path("t.log", '{\n  "median_step_ms": 10.0\n}\n')
        near = self.f.path("p.json", json.dumps([{"predicted_step_s": 0.0105}]))
        self.assertEqual(quiet(g.check_predict, "predict", log, near)[0], g.PASS)
        far = self.f.path("p2.json", json.dumps([{"predicted_step_s": 0.02}]))
        self.assertEqual(quiet(g.check_predict, "predict", log, far)[0], g.MISS)

    def test_zero3_passes_units_gathered_and_freed_and_fails_a_whole_model_gathered_or_none(self):
        def log(gathered, params=2_000_000):
            memory = {"zero": 3, "gathered_bytes": gathered, "parameter_bytes": params}
            return self.f.path("z.log", json.dumps({"median_step_ms": 9.0, "memory": memory}, indent=2) + "\n")
        self.assertEqual(quiet(g.check_zero3, "zero3", log(600_000))[0], g.PASS)
        # every unit gathered at once (never freed), or none gathered at all
        self.assertEqual(quiet(g.check_zero3, "zero3", log(2_000_000))[0], g.FAIL)
        self.assertEqual(quiet(g.check_zero3, "zero3", log(0))[0], g.FAIL)
        # a run without the memory line (plain DDP, or a crash)
        bare = self.f.path("bare.log", '{"median_step_ms": 9.0}\n')
        self.assertEqual(quiet(g.check_zero3, "zero3", bare)[0], g.FAIL)


class Script(unittest.TestCase):
    """gpu-check.sh itself: its budgets and its policy sections (read from the script's text)."""

    def setUp(self):
        here = os.path.dirname(os.path.abspath(__file__))
        with open(os.path.join(here, "gpu-check.sh")) as f:
            self.text = f.read()

    def sections(self):
        line = next(l for l in self.text.splitlines() if l.startswith("SECTIONS="))
        return [(s.split(":")[0], int(s.split(":")[1])) for s in line.split("=", 1)[1].strip('"').split()]

    def test_the_budgets_grow_section_by_section_and_end_within_8_minutes(self):
        sections = self.sections()
        ends = [end for _, end in sections]
        self.assertEqual(ends, sorted(ends))
        self.assertEqual(len(set(ends)), len(ends))
        self.assertEqual(ends[-1], 480)
        names = [name for name, _ in sections]
        # the verdict checks (the policies among them) come before the numbers
        self.assertLess(names.index("policies"), names.index("gemm"))
        self.assertLessEqual(dict(sections)["policies"], 270)
        self.assertLess(names.index("zero3"), names.index("gemm"))

    def test_zero3_runs_on_nccl_against_itself_host_staged_and_plain_ddp_and_checks_its_units(self):
        start = self.text.index("# ---- zero3:")
        block = self.text[start:self.text.index("# ---- mixed:")]
        for needle in ["--zero 3 --backend nccl --json", "--zero 3 --backend thread", "run zero3 zero3-plain",
                       "judge zero3-units", "judge zero3-vs-staged", "judge zero3-vs-plain"]:
            self.assertIn(needle, block)

    def test_every_built_in_policy_has_a_section_against_itself_host_staged_and_an_overlap_check(self):
        line = next(l for l in self.text.splitlines() if l.startswith("POLICIES=("))
        start = self.text.index(line)
        block = self.text[start:self.text.index(")", self.text.index('"zero2:', start)) + 1]
        names = [entry.split(":")[0] for entry in block.split('"')[1::2]]
        self.assertEqual(names, ["fp16", "bf16", "powersgd", "zero1", "zero2"])
        loop = self.text[self.text.index('for entry in "${POLICIES[@]}"'):]
        loop = loop[:loop.index("\ndone\n")]
        for needle in ["--backend nccl", "--backend thread", '"${LINK[@]}"', "--timeline", "losses", "overlap",
                       "run policies"]:
            self.assertIn(needle, loop)


class Binaries(unittest.TestCase):
    def test_the_glibc_a_binary_needs_is_read_from_its_elf(self):
        need = g.glibc_needed(sys.executable if os.path.exists(sys.executable) else "/bin/sh")
        self.assertRegex(need or "", r"^GLIBC_2\.\d+$")
        out = subprocess.run(["ldd", "--version"], capture_output=True, text=True).stdout
        have = tuple(int(x) for x in out.splitlines()[0].split()[-1].split("."))
        self.assertLessEqual(tuple(int(x) for x in need[6:].split(".")), have)


if __name__ == "__main__":
    unittest.main(verbosity=1)
