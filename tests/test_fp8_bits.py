"""csrc/fp8_bits.h, the integer-only e4m3 -> f16 conversion of the Hopper kernel's
``convert_mode`` variants, built for the host with the C++ compiler and checked against torch's
float8_e4m3fn over every byte pair and every selector the kernel uses (no GPU needed)."""

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

CSRC = Path(__file__).resolve().parents[1] / "csrc"
DRIVER = r"""
#include "fp8_bits.h"
#include <cstdio>
int main() {
  const uint32_t sels[6] = {kimi_ops::kSelBytes01, kimi_ops::kSelBytes23, kimi_ops::sel_byte_of_each(0),
                            kimi_ops::sel_byte_of_each(1), kimi_ops::sel_byte_of_each(2),
                            kimi_ops::sel_byte_of_each(3)};
  for (int s = 0; s < 6; ++s)
    for (uint32_t a = 0; a < 256; ++a)
      for (uint32_t b = 0; b < 256; ++b) {
        uint32_t x, y;  // a -> the low half, b -> the high half; every other byte is filler
        if (s == 0) { x = a | (b << 8) | 0x5A5A0000u; y = 0xA5A5A5A5u; }
        else if (s == 1) { x = (a << 16) | (b << 24) | 0x00005A5Au; y = 0xA5A5A5A5u; }
        else {
          const int j = s - 2;
          x = (a << (8 * j)) | (0x5A5A5A5Au & ~(0xFFu << (8 * j)));
          y = (b << (8 * j)) | (0xA5A5A5A5u & ~(0xFFu << (8 * j)));
        }
        const uint32_t r = kimi_ops::e4m3x2_to_f16x2_scaled(x, y, sels[s]);
        fwrite(&r, 4, 1, stdout);
      }
  return 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler")
def test_integer_e4m3_to_f16_is_exact(tmp_path):
    (tmp_path / "main.cpp").write_text(DRIVER)
    subprocess.run(["g++", "-O2", "-std=c++17", f"-I{CSRC}", str(tmp_path / "main.cpp"), "-o", str(tmp_path / "main")],
                   check=True)
    out = subprocess.run([str(tmp_path / "main")], check=True, capture_output=True).stdout
    got = np.frombuffer(out, dtype=np.uint32).reshape(6, 256, 256)
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float() * 2.0 ** -8
    want = values.half().view(torch.int16).numpy().astype(np.uint16).astype(np.uint32)
    finite = np.isfinite(values.numpy())
    both = finite[:, None] & finite[None, :]
    for s in range(6):
        np.testing.assert_array_equal((got[s] & 0xFFFF)[both], np.broadcast_to(want[:, None], (256, 256))[both])
        np.testing.assert_array_equal((got[s] >> 16)[both], np.broadcast_to(want[None, :], (256, 256))[both])
    # the NaN bytes (0x7F, 0xFF) read as +-480 (x 2^-8): documented, not NaN
    nan_lo = got[0, 0x7F, 0] & 0xFFFF
    assert torch.tensor([nan_lo], dtype=torch.int32).to(torch.int16).view(torch.float16).item() == 1.875
