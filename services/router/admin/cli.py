"""``epd admin``: the router's admin API from the command line (prints the JSON it gets back).

    epd admin instances
    epd admin router                            (the router itself: pid, restarts)
    epd admin drain ID | undrain ID
    epd admin add ROLE ADDRESS [--id ID]        (a new instance: prefill, decode, encoder at host:port)
    epd admin remove ID [--wait]                (it leaves once its requests are done)
    epd admin planner [--pause | --resume]      (each role's decision, inputs, reason, history)
    epd admin scale ROLE N | auto               (hold ROLE at N replicas; auto: the planner decides again)
    epd admin policies
    epd admin policy ROLE NAME                  (ROLE: prefill, decode, encoder)
    epd admin buckets [--bounds A,B,C] [--caps A,B,C,D] [--round-s S]
    epd admin keys create TENANT [--rpm N] [--tpm N] [--max-concurrency N]   (prints the key once)
    epd admin keys list
    epd admin keys revoke ID_OR_KEY             (an id from keys list, or the key itself)

``--url`` (default http://127.0.0.1:8001, or EPD_ADMIN_URL) and ``--token`` (default
EPD_ROUTER_ADMIN_TOKEN, which ``epd up`` prints) reach the router.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import httpx

from services.router.access.auth import hash_key


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="epd admin", description="the router's admin API")
    p.add_argument("--url", default=os.environ.get("EPD_ADMIN_URL", "http://127.0.0.1:8001"))
    p.add_argument("--token", default=os.environ.get("EPD_ROUTER_ADMIN_TOKEN", ""))
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("instances", help="every instance with its health, drain state, load, bucket and restarts")
    sub.add_parser("router", help="the router itself: pid and restarts")
    for name in ("drain", "undrain"):
        sub.add_parser(name, help=f"{name} one instance").add_argument("instance_id")
    add = sub.add_parser("add", help="a new instance, while the router runs")
    add.add_argument("role", choices=("prefill", "decode", "encoder"))
    add.add_argument("address", help="host:port of its gRPC server")
    add.add_argument("--id", default="", help="its instance id (default: learnt from its load reports)")
    remove = sub.add_parser("remove", help="an instance leaves: no new requests, removed once its requests are done")
    remove.add_argument("instance_id")
    remove.add_argument("--wait", action="store_true", help="answer once it is out")
    planner = sub.add_parser("planner", help="the planner: decisions per role, or pause / resume it")
    planner.add_argument("--pause", action="store_true")
    planner.add_argument("--resume", action="store_true")
    scale = sub.add_parser("scale", help="hold a role at N replicas (auto: let the planner decide again)")
    scale.add_argument("role", choices=("encoder", "prefill", "decode", "kvstore"))
    scale.add_argument("replicas", type=lambda t: None if t == "auto" else int(t), metavar="N|auto")
    sub.add_parser("policies", help="each role's policy and per-policy stats")
    change = sub.add_parser("policy", help="switch a role's policy")
    change.add_argument("role", choices=("prefill", "decode", "encoder"))
    change.add_argument("name")
    buckets = sub.add_parser("buckets", help="read (or change) the prefill buckets")
    buckets.add_argument("--bounds", type=_ints, help="three ascending token counts, e.g. 2048,8192,32768")
    buckets.add_argument("--caps", type=_ints, help="four per-bucket instance caps (0: none)")
    buckets.add_argument("--round-s", type=float, help="seconds between reallocations")
    buckets.add_argument("--room-s", type=float,
                         help="queued prefill seconds under which an instance takes a waiting request")
    keys = sub.add_parser("keys", help="API keys: create, list, revoke").add_subparsers(dest="keys_command",
                                                                                       required=True)
    create = keys.add_parser("create", help="a new API key for TENANT (its text is printed once)")
    create.add_argument("tenant")
    for limit in ("--rpm", "--tpm", "--max-concurrency"):
        create.add_argument(limit, type=int, help="this key's own limit (0: unlimited; default: the router's)")
    keys.add_parser("list", help="every key: id, tenant, limits, revoked (never the key itself)")
    keys.add_parser("revoke", help="revoke a key at once").add_argument("key", metavar="ID_OR_KEY")
    return p


def _key_request(args: argparse.Namespace) -> tuple[str, str, dict | None]:
    if args.keys_command == "create":
        limits = {k: getattr(args, k) for k in ("rpm", "tpm", "max_concurrency") if getattr(args, k) is not None}
        return "POST", "/admin/keys", {"tenant": args.tenant, **limits}
    if args.keys_command == "list":
        return "GET", "/admin/keys", None
    # The key itself is hashed here, so its text never travels (the id is a prefix of the hash).
    key_id = args.key if re.fullmatch(r"[0-9a-fA-F]+", args.key) else hash_key(args.key)
    return "POST", f"/admin/keys/{key_id.lower()}/revoke", None


def request(args: argparse.Namespace) -> tuple[str, str, dict | None]:
    """(method, path, json body) for the parsed command."""
    if args.command in ("instances", "router"):
        return "GET", f"/admin/{args.command}", None
    if args.command in ("drain", "undrain"):
        return "POST", f"/admin/instances/{args.instance_id}/{args.command}", None
    if args.command == "add":
        return "POST", "/admin/instances", {"role": args.role, "address": args.address, "instance_id": args.id}
    if args.command == "remove":
        return "DELETE", f"/admin/instances/{args.instance_id}" + ("?wait=true" if args.wait else ""), None
    if args.command == "planner":
        paused = True if args.pause else False if args.resume else None
        return ("GET", "/admin/planner", None) if paused is None else ("PUT", "/admin/planner", {"paused": paused})
    if args.command == "scale":
        return "PUT", "/admin/planner", {"roles": {args.role: {"override": args.replicas}}}
    if args.command == "policies":
        return "GET", "/admin/policies", None
    if args.command == "policy":
        return "PUT", f"/admin/policies/{args.role}", {"policy": args.name}
    if args.command == "keys":
        return _key_request(args)
    body = {k: v for k, v in (("bounds", args.bounds), ("caps", args.caps), ("round_s", args.round_s),
                              ("room_s", args.room_s)) if v is not None}
    return ("PUT" if body else "GET"), "/admin/prefill/buckets", body or None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not args.token:
        print("epd admin: no token: pass --token or set EPD_ROUTER_ADMIN_TOKEN (epd up prints it)", file=sys.stderr)
        return 2
    method, path, body = request(args)
    try:
        reply = httpx.request(method, args.url.rstrip("/") + path, json=body, timeout=120 if "wait=" in path else 10,
                              headers={"Authorization": f"Bearer {args.token}"})
    except httpx.HTTPError as exc:
        print(f"epd admin: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    if reply.status_code >= 400:
        try:
            message = reply.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = reply.text
        print(f"epd admin: {reply.status_code}: {message}", file=sys.stderr)
        return 1
    print(json.dumps(reply.json(), indent=2))
    if args.command == "keys" and args.keys_command == "create":
        print("epd admin: the key is shown this once; store it now (only its hash is kept)", file=sys.stderr)
    return 0
