"""A tiny Hub-compatible HTTP server for `attnkit push` tests (127.0.0.1, random port, a thread).

It implements exactly what huggingface_hub 2.4's `create_repo`, `create_branch`, `upload_folder`
(streamed path: preupload → NDJSON commit with base64 "file" lines; PRs opened through the
discussions API) and the card check `/api/validate-yaml` send, keeps the committed bytes in
memory per repo and ref, and can be told to answer a given status for matching requests.
Large files are answered "regular" upload mode, so no LFS/Xet storage is needed.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

REPO = r"(?P<repo>[^/]+/[^/]+)"
ROUTES = [
    ("POST", re.compile(r"^/api/repos/create$"), "create_repo"),
    ("POST", re.compile(r"^/api/validate-yaml$"), "validate_yaml"),
    ("POST", re.compile(rf"^/api/models/{REPO}/preupload/(?P<rev>.+)$"), "preupload"),
    ("POST", re.compile(rf"^/api/models/{REPO}/commit/(?P<rev>.+)$"), "commit"),
    ("POST", re.compile(rf"^/api/models/{REPO}/branch/(?P<rev>.+)$"), "create_branch"),
    ("POST", re.compile(rf"^/api/models/{REPO}/discussions$"), "create_discussion"),
    ("GET", re.compile(rf"^/api/models/{REPO}/discussions/(?P<num>\d+)$"), "get_discussion"),
    ("GET", re.compile(rf"^/api/models/{REPO}(?:/revision/(?P<rev>.+))?$"), "repo_info"),
]
ALLOWED_RELATIONS = {"adapter", "merge", "quantized", "finetune"}


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    private: bool
    refs: dict[str, dict[str, bytes]] = field(default_factory=lambda: {"main": {}})
    commits: list[dict] = field(default_factory=list)
    prs: list[int] = field(default_factory=list)


@dataclass
class FakeHub:
    token: str = "hf_test_token"
    repos: dict[str, Repo] = field(default_factory=dict)
    log: list[tuple[str, str]] = field(default_factory=list)
    cards: list[str] = field(default_factory=list)
    fail: dict[str, int] = field(default_factory=dict)  # route name → status to answer
    url: str = ""
    dump: Path | None = None  # when set, every commit also writes the ref's files to dump/REPO/REF/

    def write_dump(self, repo_id: str, ref: str) -> None:
        if self.dump is None:
            return
        for name, data in self.repos[repo_id].refs[ref].items():
            path = self.dump / repo_id / ref / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)

    def files(self, repo_id: str, ref: str = "main") -> dict[str, bytes]:
        return self.repos[repo_id].refs[ref]


def _make_handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep pytest output clean
            pass

        def _reply(self, status: int, body: dict | None = None, error_code: str | None = None) -> None:
            data = json.dumps(body if body is not None else {}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if error_code:
                self.send_header("X-Error-Code", error_code)
            if body and "error" in body:
                self.send_header("X-Error-Message", body["error"])
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _dispatch(self, method: str) -> None:
            parts = urlsplit(self.path)
            hub.log.append((method, parts.path))
            body = self._body() if method == "POST" else b""
            for m, pattern, name in ROUTES:
                match = pattern.match(parts.path)
                if m == method and match:
                    break
            else:
                return self._reply(404, {"error": f"no route {method} {parts.path}"})
            if name in hub.fail:
                status = hub.fail[name]
                return self._reply(status, {"error": f"injected {status} for {name}"})
            if self.headers.get("Authorization") != f"Bearer {hub.token}":
                return self._reply(401, {"error": "Invalid credentials in Authorization header"})
            groups = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
            repo = hub.repos.get(groups.get("repo", ""))
            if "repo" in groups and repo is None:
                return self._reply(404, {"error": "Repository not found"}, error_code="RepoNotFound")
            query = {k: v[0] for k, v in parse_qs(parts.query).items()}
            return getattr(self, name)(repo, groups, query, body)

        def do_GET(self):
            self._dispatch("GET")

        def do_POST(self):
            self._dispatch("POST")

        # --- endpoints (same names as ROUTES) ---

        def create_repo(self, _repo, _groups, _query, body):
            payload = json.loads(body)
            repo_id = f"{payload['organization']}/{payload['name']}"
            if repo_id in hub.repos:
                return self._reply(409, {"error": "You already created this model repo", "url": f"{hub.url}/{repo_id}"})
            hub.repos[repo_id] = Repo(private=payload.get("visibility") == "private" or bool(payload.get("private")))
            return self._reply(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id})

        def validate_yaml(self, _repo, _groups, _query, body):
            content = json.loads(body)["content"]
            hub.cards.append(content)
            errors = []
            match = re.match(r"^---\n(.*?)\n---\n", content, re.S)
            meta = yaml.safe_load(match.group(1)) if match else None
            if not isinstance(meta, dict):
                errors.append({"message": "metadata must be a YAML mapping"})
            else:
                if meta.get("base_model_relation") not in (None, *ALLOWED_RELATIONS):
                    errors.append({"message": f"base_model_relation {meta['base_model_relation']!r} not allowed"})
                if "base_model_relation" in meta and "base_model" not in meta:
                    errors.append({"message": "base_model_relation needs base_model"})
                if not isinstance(meta.get("model-index", []), list):
                    errors.append({"message": "model-index must be a list"})
            return self._reply(400 if errors else 200, {"errors": errors, "warnings": []})

        def _ref(self, repo: Repo, rev: str) -> dict[str, bytes] | None:
            return repo.refs.get(rev)

        def preupload(self, repo, groups, _query, body):
            ref = self._ref(repo, groups["rev"]) or {}
            files = []
            for f in json.loads(body)["files"]:
                entry = {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                if f["path"] in ref:
                    entry["oid"] = git_blob_sha1(ref[f["path"]])
                files.append(entry)
            return self._reply(200, {"files": files})

        def commit(self, repo, groups, query, body):
            lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
            if not lines or lines[0].get("key") != "header":
                return self._reply(400, {"error": "first NDJSON line must be the header"})
            rev = groups["rev"]
            if query.get("create_pr") == "1":
                repo.prs.append(len(repo.prs) + 1)
                rev = f"refs/pr/{repo.prs[-1]}"
                repo.refs[rev] = dict(repo.refs["main"])
            ref = self._ref(repo, rev)
            if ref is None:
                return self._reply(404, {"error": f"Invalid rev id: {rev}"}, error_code="RevisionNotFound")
            for line in lines[1:]:
                value = line["value"]
                if line["key"] == "file" and value.get("encoding") == "base64":
                    ref[value["path"]] = base64.b64decode(value["content"])
                elif line["key"] == "deletedFile":
                    ref.pop(value["path"], None)
                else:
                    return self._reply(400, {"error": f"fake hub does not support {line['key']}"})
            oid = hashlib.sha1(json.dumps(sorted((k, git_blob_sha1(v)) for k, v in ref.items())).encode()).hexdigest()
            repo.commits.append({"ref": rev, "header": lines[0]["value"], "oid": oid})
            hub.write_dump(groups["repo"], rev)
            pr_url = f"{hub.url}/{groups['repo']}/discussions/{rev.split('/')[-1]}" if rev.startswith("refs/pr/") else None
            return self._reply(200, {"commitUrl": f"{hub.url}/{groups['repo']}/commit/{oid}", "commitOid": oid, "pullRequestUrl": pr_url})

        def create_branch(self, repo, groups, _query, _body):
            if groups["rev"] in repo.refs:
                return self._reply(409, {"error": "Reference already exists"})
            repo.refs[groups["rev"]] = dict(repo.refs["main"])
            return self._reply(200, {})

        def create_discussion(self, repo, _groups, _query, body):
            payload = json.loads(body)
            if not payload.get("pullRequest"):
                return self._reply(400, {"error": "fake hub only opens pull requests"})
            repo.prs.append(len(repo.prs) + 1)
            repo.refs[f"refs/pr/{repo.prs[-1]}"] = dict(repo.refs["main"])
            return self._reply(200, {"num": repo.prs[-1]})

        def get_discussion(self, repo, groups, _query, _body):
            num = int(groups["num"])
            if num not in repo.prs:
                return self._reply(404, {"error": "Discussion not found"})
            return self._reply(200, {
                "title": "attnkit upload", "num": num, "author": {"name": "tester"},
                "createdAt": "2026-01-01T00:00:00.000Z", "status": "draft", "isPullRequest": True,
                "repo": {"name": groups["repo"], "type": "model"}, "events": [],
                "changes": {"base": "refs/heads/main"}, "filesWithConflicts": [],
            })

        def repo_info(self, repo, groups, _query, _body):
            return self._reply(200, {"id": groups["repo"], "private": repo.private, "sha": "0" * 40, "siblings": []})

    return Handler


class HubServer:
    """Context manager: `with HubServer() as hub: ... hub.url ...`."""

    def __init__(self, token: str = "hf_test_token", port: int = 0, dump: Path | None = None):
        self.hub = FakeHub(token=token, dump=dump)
        self._server = ThreadingHTTPServer(("127.0.0.1", port), _make_handler(self.hub))
        self.hub.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self.hub

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


if __name__ == "__main__":
    # Stand-alone for trying `attnkit push` without the Hub:
    #   python -m tests.hub_server --port 8765 --token hf_local --dump /tmp/fakehub
    parser = argparse.ArgumentParser(description="a local fake Hugging Face Hub for `attnkit push`")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--token", default="hf_local")
    parser.add_argument("--dump", type=Path, default=None, help="write committed files to DUMP/REPO/REF/")
    cli = parser.parse_args()
    server = HubServer(cli.token, cli.port, cli.dump)
    with server as fake:
        print(f"fake Hub at {fake.url} (token {cli.token}); Ctrl-C to stop", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass
