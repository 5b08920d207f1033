"""docs/PATCHES.md, written from the `Patch` records so that it cannot drift from them:
`python -m vllm_dsa_dbo.diagnostics.catalogue > docs/PATCHES.md`."""

from __future__ import annotations

from collections.abc import Iterable

from vllm_dsa_dbo.patches._shared import Patch

HEADER = """\
# Patch catalogue

Generated from the plugin's `Patch` records by `python -m vllm_dsa_dbo.diagnostics.catalogue >
docs/PATCHES.md`; the suite fails when this file is not what they write. Per patch: the vLLM
symbols it sets, why, how, the upstream change that would retire it, and the vLLM releases
whose code it fits (the sha256 of the symbols' source it was written against: on any other
code it is left unapplied, and `vllm-dsa-dbo status --check` says why).
"""


def entry(patch: Patch) -> str:
    """One patch's section."""
    symbols = ", ".join(f"`{name}`" for name in patch.replaces)
    fits = ", ".join(f"{release} (`{digest}`)" for release, digest in sorted(patch.fits.items()))
    lines = [
        f"### `{patch.name}`",
        "",
        f"- **vLLM symbols**: in `{patch.target}`, {symbols}",
        f"- **Fits vLLM**: {fits}",
    ]
    if patch.differs:
        lines.append(f"- **Between releases**: {patch.differs}")
    if patch.requires:
        lines.append(f"- **Requires**: {', '.join(f'`{name}`' for name in patch.requires)}")
    if patch.rocm_only:
        lines.append("- **ROCm only**: off ROCm its target need not import")
    lines += [
        f"- **Why**: {patch.why}",
        f"- **How**: {patch.how}",
        f"- **Upstream**: {patch.upstream}",
        f"- **Remove when**: {patch.remove_when}",
    ]
    return "\n".join(lines) + "\n"


def section(title: str, patches: Iterable[Patch]) -> str:
    return f"\n## {title}\n\n" + "\n".join(entry(patch) for patch in patches)


def catalogue() -> str:
    """docs/PATCHES.md: the fix's patches in the order they apply, then the load-time
    check's and the isolation checker's."""
    from vllm_dsa_dbo.diagnostics import isolation, load_check
    from vllm_dsa_dbo.patches import fix_patches
    from vllm_dsa_dbo.settings import CHECK_ENV

    return (
        HEADER
        + section("The fix", fix_patches())
        + section("The load-time check", load_check.PATCHES)
        + section(f"The isolation checker (only with {CHECK_ENV} set)", isolation.PATCHES)
    )


if __name__ == "__main__":
    print(catalogue(), end="")
