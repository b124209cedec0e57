"""scripts/xla_live_buffers.py on a small dump written here in XLA's text formats."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
from unittest import mock

from absl.testing import absltest

import testing  # tests/testing.py

xla_live_buffers = testing.load_script("scripts/xla_live_buffers.py")

MIB = 2**20
# A parameter (not a temporary), and two temporary allocations: a (64 MiB) lives 1-3, b and
# c (32 MiB each, sharing an allocation) live 2-2 and 3-4. Peak: position 2 (a + b = 96 MiB;
# at 3, a + c = 96 MiB too: the first wins).
ASSIGNMENT = f"""allocation 0: size {256 * MIB}, parameter 0, shape |f32[1024,65536]| at ShapeIndex {{}}:
 value: <1 param.0 @0> (size={256 * MIB},offset=0): f32[1024,65536]{{1,0}}
allocation 1: size {64 * MIB}, preallocated-temp:
 value: <2 fusion.a @0> (size={64 * MIB},offset=0): f32[4096,4096]{{1,0}}
allocation 2: size {32 * MIB}, preallocated-temp:
 value: <3 custom-call.b @0> (size={32 * MIB},offset=0): bf16[4096,4096]{{1,0}}
 value: <4 copy.c{{}} @0> (size={32 * MIB},offset=0): bf16[4096,4096]{{1,0}}
"""
LIVE_RANGE = """HloLiveRange (max 5):
  InstructionSequence:
    0:param.0
    1:fusion.a
    2:custom-call.b
    3:copy.c
    4:root
  BufferLiveRange:
    param.0{}:0-5
    fusion.a{}:1-3
    custom-call.b{}:2-2
    copy.c{}:3-4
"""
PREFIX = "module_0001.jit_body.sm_9.0_gpu_after_optimizations"


class XlaLiveBuffersTest(absltest.TestCase):

    def _run(self, directory, *extra):
        out = io.StringIO()
        argv = ["xla_live_buffers.py", directory, *extra]
        with mock.patch.object(sys, "argv", argv), contextlib.redirect_stdout(out):
            rc = xla_live_buffers.main()
        return rc, out.getvalue()

    def _dump(self, directory, live_range=True):
        with open(os.path.join(directory, PREFIX + "-buffer-assignment.txt"), "w") as f:
            f.write(ASSIGNMENT)
        if live_range:
            with open(os.path.join(directory, PREFIX + "-live-range.txt"), "w") as f:
                f.write(LIVE_RANGE)

    def test_peak_and_what_is_alive_there(self):
        with tempfile.TemporaryDirectory() as d:
            self._dump(d)
            rc, text = self._run(d)
        self.assertEqual(rc, 0)
        self.assertIn("0.094 GiB at #2 (custom-call.b)", text)
        lines = [line for line in text.splitlines() if "MiB" in line]
        self.assertLen(lines, 2)  # a and b; not the parameter, not c (born at 3)
        self.assertIn("fusion.a", lines[0])  # largest first
        self.assertIn("64.0 MiB", lines[0])
        self.assertIn("custom-call.b", lines[1])

    def test_without_live_ranges_lists_the_largest_values(self):
        with tempfile.TemporaryDirectory() as d:
            self._dump(d, live_range=False)
            rc, text = self._run(d, "--top", "1")
        self.assertEqual(rc, 0)
        self.assertIn("no live-range file", text)
        self.assertIn("fusion.a", text)
        self.assertNotIn("param.0", text)

    def test_missing_module_names_the_directory_and_module(self):
        with tempfile.TemporaryDirectory() as d:
            self._dump(d)
            with self.assertRaisesRegex(SystemExit, r"'jit_other'"):
                self._run(d, "--module", "jit_other")


if __name__ == "__main__":
    absltest.main()
