"""Print the problem table of docs/problems.md (markdown) from the registry: python scripts/problem_table.py"""

from pkb.registry import all_problems


def problem_table() -> str:
    lines = ["| # | problem | v | category | source | world sizes | upstream | tests | benchmarks |",
             "|---|---|---|---|---|---|---|---|---|"]
    for p in all_problems().values():
        lines.append(f"| {p.upstream_id or '-'} | `{p.name}` | {p.version} | {p.category} | {p.source} | "
                     f"{', '.join(map(str, p.world_sizes))} | {len(p.upstream)} | {len(p.tests)} | {len(p.benchmarks)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(problem_table())
