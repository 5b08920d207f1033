# CPU of one call of each way the tests take files from vLLM's sdist; run from the repository root.
import sys, time, tempfile
sys.path.insert(0,'tests')
from pathlib import Path
import upstream_tree, vllm_sdist
from vllm_dsa_dbo import upstream
HOOK_INPUTS = ("PKG-INFO", "pyproject.toml", ".pre-commit-config.yaml", "tools/", ".buildkite/")
for name, f in [("released", lambda d: upstream_tree.extract_files(vllm_sdist.fetch(), d, (*upstream.EDITS, *HOOK_INPUTS))),
                ("tree", lambda d: upstream_tree.extract_tree(vllm_sdist.fetch(), d)),
                ("pristine", lambda d: upstream_tree.extract_files(vllm_sdist.fetch(), d, ("vllm/", "tests/", *HOOK_INPUTS)))]:
    for i in range(3):
        t=time.process_time(); w=time.monotonic(); r=f(Path(tempfile.mkdtemp()))
        print(name, f"{time.process_time()-t:.2f} cpu-s {time.monotonic()-w:.2f} s", sum(1 for _ in r.rglob('*')))
