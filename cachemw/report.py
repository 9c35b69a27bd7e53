"""How a node's statistics read to a person: the table `cachemw stats` and the main job print."""
from __future__ import annotations

from .config_values import format_size


def _why_not(tier: dict) -> str:
    return f"NO ({tier['unusable']})" if tier.get("unusable") else "NO (out of space)"


def format_stats(stats: dict) -> str:
    c = stats["counters"]
    lines = [f"node {stats['node_id']} (daemon pid {stats['pid']})",
             f"  {'tier':<6} {'used':>11} {'capacity':>11} {'blocks':>8} {'hits':>9} "
             f"{'evictions':>9} {'demoted':>8}  admitting"]
    for name, t in stats["tiers"].items():
        lines.append(f"  {name:<6} {format_size(t['used_bytes']):>11} {format_size(t['capacity_bytes']):>11} "
                     f"{t['blocks']:>8} {t['hits']:>9} {t['evictions']:>9} {t['demotions']:>8}  "
                     f"{'yes' if t['admitting'] else _why_not(t)}")
    total = c["hits"] + c["misses"] + c["fallbacks"] + c["bypassed"]
    ratio = c["hits"] / total if total else 0.0
    lines += [
        f"  reads: {c['hits']} hits, {c['misses']} misses, hit ratio {ratio:.1%}; from other "
        f"nodes: {c.get('remote_hits', 0)} hits, {c.get('remote_reads', 0)} fetched by the owner, "
        f"{c.get('direct_failures', 0)} owner transfers failed",
        f"  from source: {format_size(c['bytes_from_source'])}; fallbacks (daemon unreachable): "
        f"{c['fallbacks']}; bypassed (not admitted): {c['bypassed']}",
        f"  corrupt blocks repaired: {c['corrupt_repaired']}; unreadable blocks read from the source: "
        f"{c.get('tier_read_errors', 0)}; fill errors: {c['fill_errors']}; "
        f"blocks re-indexed at start: {c['reindexed']}",
        f"  readers' time: hits {c.get('hit_seconds', 0):.2f} s, from other nodes "
        f"{c.get('remote_hit_seconds', 0):.2f} s, waiting on the daemon "
        f"{c.get('lease_seconds', 0):.2f} s, from source {c.get('source_seconds', 0):.2f} s",
    ]
    return "\n".join(lines)
