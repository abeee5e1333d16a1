"""``nestpipe.utils.host``: what the benchmarks record of the machine beside their figures."""

from __future__ import annotations

import json
import subprocess
import sys

from nestpipe.utils.host import ISA_FLAGS, describe_host, host_line


def test_describe_host_reads_the_model_and_the_isa_flags(tmp_path):
    fake = tmp_path / "cpuinfo"
    fake.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu sse4_2 avx2 avx512f foo\n\n"
                    "processor\t: 1\nmodel name\t: Other\nflags\t\t: fpu\n")
    info = describe_host(str(fake))
    assert info["cpu_model"] == "Test CPU 9000" and info["isa"] == ["sse4_2", "avx2", "avx512f"]
    assert "Test CPU 9000" in host_line(info) and "avx512f" in host_line(info)
    # negative control: a CPU without the flags lists none of them
    fake.write_text("model name\t: Plain\nflags\t\t: fpu vme\n")
    assert describe_host(str(fake))["isa"] == [] and "no ISA flags read" in host_line(describe_host(str(fake)))
    missing = describe_host(str(tmp_path / "absent"))
    assert missing["isa"] == [] and missing["logical_cpus"] >= 1
    assert set(ISA_FLAGS) >= set(describe_host()["isa"])


def test_kernels_info_reports_the_host():
    p = subprocess.run([sys.executable, "-m", "nestpipe", "kernels-info", "--json"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    host = json.loads(p.stdout)["host"]
    assert host["usable_cpus"] >= 1 and isinstance(host["isa"], list)
