#!/usr/bin/env python3
"""Where a server's instructions go, by component, from callgrind dumps.

    bench/components.py [--json OUT.json] LABEL=CALLS:CLAIM_DUMP:CYCLE_DUMP...

Each LABEL (a server: service, database floor, bare floor) comes with two
callgrind dumps of the server: one taken over CALLS lone Claims of fresh keys,
one over CALLS Claim+Complete cycles (bench/breakdown.sh makes them). Per
Claim is the first dump divided by CALLS; per Complete is the cycle dump's
per-cycle figure minus the per-Claim one, component by component (so a small
component can come out slightly negative: the two runs are not the same
instructions, only the same work).

Attribution. Every function's exclusive (self) instructions go to exactly one
component, chosen from its name (the first rule of COMPONENTS that matches
the function's owner: the type a `drop_in_place` drops, the type of an
`<X as Trait>::method` impl when X is not a std wrapper, else the leading
path). So the exclusive columns add up to the dump's total, which is printed
beside them as a check. Code inlined into a function counts as that
function's: a `tracing` macro inlined into a service function is the
service's, a prost decoder inlined into tonic's is tonic's. Release builds
inline a lot; the inclusive column is the other view.

Two views per component:
  - exclusive: the self instructions of its functions;
  - shared code charged to callers: the shared helpers (malloc/free, memcpy,
    core/alloc/std generic code, formatting) are charged to the components
    that called them, in proportion to each caller's inclusive call cost
    (gprof's assumption: every call to a helper costs the same), climbing
    through helpers that call helpers; this column adds up to the total too;
  - inclusive: instructions spent while a function of the component was on
    the stack, from the calls that enter the component from outside it (an
    overlap: tracing inside the lifecycle counts in both; does not add up).
"""

import json
import re
import sys
from collections import defaultdict

# (component, regular expression on the owner path). First match wins.
# Components whose code every other one calls are marked shared in SHARED.
COMPONENTS = [
    ("tracing spans/events", r"^(tracing|tracing_core|tracing_subscriber|tracing_opentelemetry|tracing_log|opentelemetry\w*|sharded_slab|matchers|nu_ansi_term)::|^idempotency_service::telemetry"),
    ("metrics", r"^(metrics|metrics_util|metrics_exporter_prometheus|quanta)::|^idempotency_service::metrics"),
    ("access policy", r"^(governor|subtle|sha2)::|^idempotency_service::(access|grpc::guard)"),
    ("replay cache", r"^quick_cache::|^idempotency_service::store::cache"),
    ("coalescer hand-off", r"^idempotency_service::store::coalesce"),
    ("waiters", r"^idempotency_service::waiters"),
    ("store: SQL and row mapping (service)", r"^idempotency_service::store"),
    ("lifecycle (service)", r"^idempotency_service::lifecycle"),
    ("gRPC adapter: validation, conversion (service)", r"^idempotency_service::(grpc|domain|error)"),
    ("service: other", r"^idempotency_service::"),
    ("floor's own code", r"^idempotency_floor::"),
    ("prost decode/encode", r"^(prost|prost_types|tonic_prost|idempotency_proto)::"),
    ("sqlx encode/decode/pool", r"^(sqlx|sqlx_core|sqlx_postgres|hashlink|crc|crc_catalog|atoi|whoami|md5|stringprep|hkdf|hmac|event_listener|futures_intrusive|crossbeam_queue)::"),
    ("tonic/hyper/h2", r"^(tonic|tonic_health|tonic_reflection|hyper|hyper_util|h2|http|http_body|http_body_util|httparse|tower|tower_layer|tower_service|tokio_util::codec|bytes|indexmap|slab|pin_project\w*|axum|matchit|httpdate|base64|percent_encoding)::"),
    ("tokio: I/O driver, sockets", r"^(tokio::(io|net|runtime::io)|mio|socket2)::|^tokio::(io|net|runtime::io)::"),
    ("tokio: scheduling, wake-ups, timers, sync", r"^(tokio|tokio_util|tokio_stream|futures_\w+|futures|parking_lot\w*|lock_api|crossbeam_\w+|atomic_waker)::"),
    ("system call wrappers (libc)", r"^(epoll_wait|epoll_ctl|__?(libc_)?(write|writev|read|readv|recv|recvfrom|send|sendto|sendmsg|recvmsg|close|accept4?)|syscall|__GI___\w+|futex\w*|__lll_\w+|clock_gettime|__clock_gettime\w*|__vdso\w*|_?_?pthread_\w+|sched_yield|eventfd_write)(@.*)?$"),
    ("allocation (malloc/free)", r"^(malloc|free|realloc|calloc|cfree|posix_memalign|aligned_alloc|memalign|_int_\w+|malloc_consolidate|tcache\w*|unlink_chunk|__libc_(malloc|free|realloc|calloc|memalign)|__rust_(alloc|dealloc|realloc|alloc_zeroed)|__rdl_\w+|__rg_\w+|alloc::alloc::\w+|unlink_chunk\S*|_mid_memalign\S*|sysmalloc|systrim\S*)$|^(__rustc::)?(__rust_|__rdl_|__rg_)"),
    ("memcpy/memset/memcmp (libc)", r"^(__)?(mem(cpy|move|set|cmp|chr|rchr)|bcmp|str\w+)(_\w+)?$"),
    ("formatting (core::fmt)", r"^(core|alloc|std)::fmt::|^alloc::(string|str)::.*(format|to_string)|^core::fmt"),
    ("core/alloc/std generic code", r"^(core|alloc|std|hashbrown|smallvec|once_cell|arc_swap|rand\w*|itoa|ryu|memchr|either|equivalent|foldhash|ahash|rustc_demangle|zmij)::"),
]
SHARED = {
    "allocation (malloc/free)",
    "memcpy/memset/memcmp (libc)",
    "core/alloc/std generic code",
    "formatting (core::fmt)",
}
# Layers under (or around) every other one: their inclusive figure counts
# each crossing again and means nothing, so the inclusive table leaves them out.
ON_EVERY_STACK = {
    "tonic/hyper/h2",
    "tokio: scheduling, wake-ups, timers, sync",
    "core/alloc/std generic code",
}
REST = "the rest (unknown symbols, ld.so, libc other)"
ORDER = [name for name, _ in COMPONENTS] + [REST]
RULES = [(name, re.compile(pattern)) for name, pattern in COMPONENTS]

# Wrappers whose `<X as Trait>` tells nothing about whose code runs: the
# owner is then the first crate path inside them.
WRAPPERS = re.compile(r"^(&(mut )?|\*(const|mut) |core::|alloc::|std::|\[|\(|dyn |F$|T$|S$)")


def owner(name):
    """The path a function belongs to, for the rules: the dropped type of a
    drop_in_place, the Self type of a trait impl unless it is a std wrapper
    (then the first non-std path inside the name), else the name itself."""
    name = name.strip()
    m = re.match(r"^core::ptr::drop_in_place<(.*)>$", name)
    if m:
        name = m.group(1).lstrip("&*").strip()
        if name.startswith("("):
            name = name[1:]
        name = re.sub(r"^(mut |const )", "", name)
    if name.startswith("<"):
        inner = name[1:]
        self_type = re.split(r" as |>::", inner, maxsplit=1)[0]
        if not WRAPPERS.match(self_type):
            return self_type
        # A std wrapper around something: the first crate path that is not std's.
        for path in re.findall(r"[A-Za-z_][A-Za-z0-9_]*::[A-Za-z0-9_:]+", inner):
            if not re.match(r"^(core|alloc|std)::", path):
                if re.search(r" as (core::future|core::ops|alloc|core::clone|core::iter)", inner):
                    return path
        return self_type
    return name


def classify(name):
    subject = owner(name)
    for component, rule in RULES:
        if rule.search(subject):
            return component
    # The owner matched nothing (`<&T as core::fmt::Debug>::fmt`, say): the
    # first path in the name that a rule knows.
    for path in re.findall(r"[A-Za-z_][A-Za-z0-9_]*::[A-Za-z0-9_:]+", name):
        for component, rule in RULES:
            if rule.search(path):
                return component
    return REST


def parse(path):
    """Self cost per function, call edges (caller, callee, inclusive cost),
    and the dump's total (Ir)."""
    names = {}  # (kind, id) -> name, kinds share the fn namespace
    self_cost = defaultdict(int)
    edges = defaultdict(int)
    total = None
    current = None
    callee = None
    pending_call = False

    def resolve(spec):
        m = re.match(r"^\((\d+)\)(?: (.*))?$", spec)
        if not m:
            return spec
        if m.group(2) is not None:
            names[m.group(1)] = m.group(2)
        return names.get(m.group(1), f"fn#{m.group(1)}")

    with open(path, errors="replace") as f:
        for line in f:
            if not line or line == "\n":
                continue
            c = line[0]
            if c.isdigit() or c in "+-*":
                fields = line.split()
                cost = int(fields[1]) if len(fields) > 1 else 0
                if pending_call:
                    edges[(current, callee)] += cost
                    pending_call = False
                else:
                    self_cost[current] += cost
                continue
            if line.startswith("fn="):
                current = resolve(line[3:].rstrip("\n"))
            elif line.startswith("cfn="):
                callee = resolve(line[4:].rstrip("\n"))
            elif line.startswith("calls="):
                pending_call = True
            elif line.startswith("summary:") or line.startswith("totals:"):
                total = int(line.split()[1])
    if total is None:
        raise SystemExit(f"components: no summary line in {path}")
    return self_cost, edges, total


def breakdown(path):
    self_cost, edges, total = parse(path)
    component_of = {}

    def comp(fn):
        if fn not in component_of:
            component_of[fn] = classify(fn)
        return component_of[fn]

    exclusive = defaultdict(int)
    for fn, cost in self_cost.items():
        exclusive[comp(fn)] += cost

    # Shared helpers charged to their callers, in proportion to call costs.
    callers = defaultdict(list)
    for (caller, callee), cost in edges.items():
        if caller != callee and cost > 0:
            callers[callee].append((caller, cost))
    charged = defaultdict(float)

    def charge(fn, amount, depth, seen):
        if comp(fn) not in SHARED:
            charged[comp(fn)] += amount
            return
        ups = [(c, w) for c, w in callers.get(fn, ()) if c not in seen]
        weight = sum(w for _, w in ups)
        if depth >= 12 or weight == 0:
            charged[comp(fn)] += amount
            return
        for caller, w in ups:
            charge(caller, amount * w / weight, depth + 1, seen | {fn})

    for fn, cost in self_cost.items():
        if cost:
            if comp(fn) in SHARED:
                charge(fn, cost, 0, frozenset())
            else:
                charged[comp(fn)] += cost

    # Inclusive: the calls that enter a component from another one.
    inclusive = defaultdict(int)
    for (caller, callee), cost in edges.items():
        if comp(caller) != comp(callee):
            inclusive[comp(callee)] += cost

    return {
        "total": total,
        "exclusive": dict(exclusive),
        "charged": {k: round(v) for k, v in charged.items()},
        "inclusive": dict(inclusive),
        "top_rest": sorted(((c, f) for f, c in self_cost.items() if comp(f) == REST), reverse=True)[:15],
    }


def per_call(result, calls):
    return {view: {k: v / calls for k, v in result[view].items()} for view in ("exclusive", "charged", "inclusive")} | {
        "total": result["total"] / calls
    }


def minus(a, b):
    out = {"total": a["total"] - b["total"]}
    for view in ("exclusive", "charged", "inclusive"):
        keys = set(a[view]) | set(b[view])
        out[view] = {k: a[view].get(k, 0) - b[view].get(k, 0) for k in keys}
    return out


def n(value):
    return f"{value:,.0f}"


def main(argv):
    json_out = None
    if argv[:1] == ["--json"]:
        json_out, argv = argv[1], argv[2:]
    if not argv:
        raise SystemExit(__doc__)
    servers = {}
    for spec in argv:
        label, _, rest = spec.partition("=")
        calls, claim_dump, cycle_dump = rest.split(":")
        calls = int(calls)
        claim, cycle = breakdown(claim_dump), breakdown(cycle_dump)
        for name, result in (("claim", claim), ("cycle", cycle)):
            check = sum(result["exclusive"].values())
            if check != result["total"]:
                raise SystemExit(f"components: {label} {name}: exclusive costs add up to {check}, the total is {result['total']}")
        per_claim = per_call(claim, calls)
        per_cycle = per_call(cycle, calls)
        servers[label] = {
            "calls": calls,
            "claim": per_claim,
            "complete": minus(per_cycle, per_claim),
            "cycle": per_cycle,
            "rest_claim": claim["top_rest"],
            "rest_cycle": cycle["top_rest"],
        }

    labels = list(servers)
    lines = []
    for view, title in (
        ("exclusive", "exclusive instructions (self cost of each component's functions; adds up to the total)"),
        ("charged", "shared code charged to callers (malloc, memcpy, core/alloc/std, fmt in their callers' components; adds up to the total)"),
        ("inclusive", "inclusive instructions (entered from another component; overlaps, does not add up; tonic/h2, tokio's scheduler and core/std, on every stack, left out)"),
    ):
        lines += [f"### Per call, {title}", ""]
        header = "| component | " + " | ".join(f"{l}: Claim | {l}: Complete" for l in labels) + " |"
        lines += [header, "|---|" + "---:|" * (2 * len(labels))]
        components = [c for c in ORDER if any(
            abs(servers[l][k][view].get(c, 0)) >= 0.5 for l in labels for k in ("claim", "complete"))
            and not (view == "inclusive" and c in ON_EVERY_STACK)]
        for c in components:
            cells = []
            for l in labels:
                cells += [n(servers[l]["claim"][view].get(c, 0)), n(servers[l]["complete"][view].get(c, 0))]
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        if view != "inclusive":
            cells = []
            for l in labels:
                cells += [n(sum(servers[l][k][view].values())) for k in ("claim", "complete")]
            lines.append("| **sum** | " + " | ".join(f"**{c}**" for c in cells) + " |")
        cells = []
        for l in labels:
            cells += [n(servers[l][k]["total"]) for k in ("claim", "complete")]
        lines.append("| **total (callgrind summary)** | " + " | ".join(f"**{c}**" for c in cells) + " |")
        lines.append("")
    lines += ["### The largest functions left in 'the rest' (per cycle run, self instructions)", ""]
    for l in labels:
        for cost, fn in servers[l]["rest_cycle"][:8]:
            lines.append(f"- {l}: {n(cost / servers[l]['calls'])} per cycle: `{fn[:140]}`")
    lines.append("")
    print("\n".join(lines))
    if json_out:
        with open(json_out, "w") as f:
            json.dump(servers, f, indent=2, default=str)


if __name__ == "__main__":
    main(sys.argv[1:])
