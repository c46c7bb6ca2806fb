#!/usr/bin/env python3
"""Tests of the measures: the scanner (scripts/rust_items.py) and scripts/longest-fns.sh on the
fixture scripts/fixtures/items.rs, whose functions carry their lengths in their doc lines; the
gradient's way (scripts/gradient_way.py) and the built-in policy names (scripts/house_figures.py)
on scripts/fixtures/house/, a house in the shape the collective contract takes after its
refactor, with a hand-written callgrind dump of one step through it.
Run: python3 scripts/test_measures.py (CI runs it)."""

import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FIXTURE = "scripts/fixtures/items.rs"
HOUSE = os.path.join(HERE, "fixtures", "house")
sys.path.insert(0, HERE)

import rust_items  # noqa: E402


class LongestFunctions(unittest.TestCase):
    def test_the_fixture_counts_bodies_only_and_leaves_test_code_out(self):
        # a multi-line declaration has no length (the old awk ran it on to a later brace), a
        # one-line fn closes on its line, `pub(crate) unsafe fn` and `extern "C" fn` count,
        # braces in comments, strings and chars do not, and #[test], #[cfg(test)] modules
        # and cfg(all(test, ..)) items are left out
        out = subprocess.run(["bash", "scripts/longest-fns.sh", FIXTURE], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
        self.assertEqual(out.splitlines(), [
            f"10 {FIXTURE}:24 copy_raw",
            f"6 {FIXTURE}:58 on_done",
            f"4 {FIXTURE}:39 Ring::new",
            f"3 {FIXTURE}:101 outside_tests",
            f"3 {FIXTURE}:15 Backend::twice",
            f"3 {FIXTURE}:52 Wrapper::layer_norm",
            f"3 {FIXTURE}:59 helper",
            f"1 {FIXTURE}:21 one_line",
        ])


class Items(unittest.TestCase):
    def setUp(self):
        self.items = rust_items.scan(os.path.join(ROOT, FIXTURE))

    def fn(self, name, decl=False):
        return next(f for f in self.items.fns if f.name == name and f.decl == decl)

    def test_a_function_knows_the_impl_or_trait_around_it(self):
        implemented = self.fn("layer_norm")
        self.assertEqual((implemented.impl.trait, implemented.impl.self_type), ("Backend", "Wrapper"))
        self.assertEqual(self.fn("layer_norm", decl=True).trait_def.name, "Backend")
        self.assertEqual((self.fn("new").impl.trait, self.fn("new").impl.self_type), (None, "Ring"))
        self.assertIsNone(self.fn("helper").impl)  # a function inside a function is no method
        self.assertEqual(self.items.fn_at(60).name, "helper")
        self.assertEqual(self.items.fn_at(62).name, "on_done")

    def test_string_literals_know_test_code(self):
        strings = {text: test for _, text, test, _ in self.items.strings}
        self.assertEqual(strings, {
            '"a brace in a string: } {"': False,
            'r#"raw "}" string"#': False,
            "\"test code's string\"": True,
            '"slow"': True,  # in the attribute #[cfg(all(test, feature = "slow"))]
        })


def way(*args):
    """gradient_way.py on the fixture house's dump: (exit status, stdout, stderr)."""
    out = subprocess.run([sys.executable, os.path.join(HERE, "gradient_way.py"), "way.callgrind", *args],
                         cwd=HOUSE, capture_output=True, text=True)
    return out.returncode, out.stdout, out.stderr


def section(out, name):
    """The figure line `NAME N: ...` and the indented lines under it."""
    lines = out.splitlines()
    k = next(k for k, l in enumerate(lines) if l.startswith(name + " "))
    block = [lines[k]]
    for l in lines[k + 1:]:
        if not l.startswith(" "):
            break
        block.append(l.strip())
    return block


class GradientWay(unittest.TestCase):
    def test_the_refactored_way_has_three_layers(self):
        # the layers that wrap the group (Layer: the meter, the tracer) and arithmetic traits
        # implemented for f32/f64 (Element) ran too, and do not count; two implementations of
        # the group (a layered one over the host one) are one layer
        rc, out, err = way()
        self.assertEqual(rc, 0, err)
        self.assertEqual(section(out, "dispatch"), [
            "dispatch 3: traits that chose an implementation between the reducer and the transport",
            "ReducerPolicy: AllReduce::reduce",
            "ProcessGroup: HostGroup::all_reduce, Layered::all_reduce",
            "Transport: ThreadTransport::all_reduce",
        ])

    def test_a_conversion_inside_another_is_part_of_it(self):
        # lend_buffer is written as lend_storage then into_buffer: one change of form, not three
        rc, out, err = way()
        self.assertEqual(section(out, "forms"), [
            "forms 2: changes of form of the bucket's bytes",
            "Tensor::lend_buffer (Tensor -> Buffer)  (crates/tensor/src/tensor.rs)",
            "Tensor::restore_buffer (Buffer -> Tensor)  (crates/tensor/src/tensor.rs)",
            "inside another change of form only (part of it), not counted: 2",
            "Storage::into_buffer (Storage -> Buffer)  (crates/tensor/src/storage.rs)",
            "Tensor::lend_storage (Tensor -> Storage)  (crates/tensor/src/tensor.rs)",
        ])

    def test_a_call_back_counts_and_an_event_does_not(self):
        # the group calls back into the reducer (counted); the bus's subscriber calling the bus,
        # a continuation calling the comm stream, and a continuation that `then` ran at once,
        # inlined (the work had completed: timing decides), run inside events (listed apart)
        rc, out, err = way()
        block = section(out, "reentries")
        self.assertEqual(block[0], "reentries 1: files entered again on one call chain, outside an event")
        self.assertTrue(block[1].startswith("crates/ddp/src/reducer.rs: "), block)
        self.assertTrue(block[2].startswith("through an event (GradSubscriber, Promise, Work, TensorPromise, TensorWork), "
                                            "not counted: 3"), block)
        self.assertEqual([l.split(":")[0] for l in block[3:]],
                         ["crates/autograd/src/bus.rs", "crates/comm/src/stream.rs", "crates/ddp/src/group/host.rs"])
        self.assertIn("files 11:", out)

    def test_check_fails_above_a_limit_and_passes_at_it(self):
        with tempfile.NamedTemporaryFile("w", suffix=".limits", delete=False) as f:
            f.write("files 11\ndispatch 3\nforms 2\nreentries 1\n")
        try:
            rc, out, err = way("--check", f.name)
            self.assertEqual((rc, err), (0, ""))
            with open(f.name, "w") as g:
                g.write("files 11\ndispatch 2  # one below\nforms 3\nreentries 1\n")
            rc, out, err = way("--check", f.name)
            self.assertEqual(rc, 1)
            self.assertIn("dispatch 3 is above its limit 2", err)
            self.assertIn("forms 2 is below its limit 3: lower the limit to 2", out)
        finally:
            os.unlink(f.name)


class HouseFigures(unittest.TestCase):
    def test_the_built_in_names_come_from_the_registry_entries(self):
        # an option's `name` inside an entry is no policy
        here = os.getcwd()
        os.chdir(HOUSE)
        try:
            import house_figures
            self.assertEqual(house_figures.built_in_policy_names(), ["allreduce", "powersgd", "zero3"])
        finally:
            os.chdir(here)


if __name__ == "__main__":
    unittest.main()
