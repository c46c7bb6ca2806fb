#!/usr/bin/env python3
"""Tests of the measures' scanner (scripts/rust_items.py) and of scripts/longest-fns.sh, on the
fixture scripts/fixtures/items.rs, whose functions carry their lengths in their doc lines.
Run: python3 scripts/test_measures.py (CI runs it)."""

import os
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FIXTURE = "scripts/fixtures/items.rs"
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


if __name__ == "__main__":
    unittest.main()
