"""What is live at the peak of a run of explore_nvme_offload.py (every storage the tracker saw, device and host
together), from its timeline CSV and its RESULT line (the swap buffers' serials): python
experiments/explore_nvme_offload_breakdown.py LOG VARIANT [RANK [WORLD]]."""
import json
import sys
from pathlib import Path

import pandas as pd

log, variant = Path(sys.argv[1]), sys.argv[2]
rank = int(sys.argv[3]) if len(sys.argv) > 3 else 0
world = int(sys.argv[4]) if len(sys.argv) > 4 else 1
infos, header_world = [], None
for line in log.read_text().splitlines():
    if line.startswith(f"== {variant} world="):
        header_world = int(line.split("world=")[1].split()[0])
    elif line.startswith("== "):
        header_world = None
    elif "RESULT" in line and header_world == world and f'"variant": "{variant}"' in line and f'"rank": {rank},' in line:
        infos.append(json.loads(line[line.index("RESULT") + 7:]))
info = infos[-1]  # the latest run of the variant at this world size (its timeline CSV is the one on disk)
aio = set(info.get("aio_serials_tracked") or []) if isinstance(info.get("aio_serials_tracked"), list) else set()
t = pd.read_csv(Path(__file__).with_name("explore_nvme_offload_runs") / f"{variant}.w{world}.rank{rank}.csv")
t = t[t["serial"] >= 0].reset_index(drop=True)
total = t["delta_bytes"].cumsum()
for title, upto in (("all storages", total.idxmax()),):
    live = {}
    first = {}
    for row in t.iloc[: upto + 1].itertuples():
        live[row.serial] = live.get(row.serial, 0) + row.delta_bytes
        first.setdefault(row.serial, (row.step, row.phase, row.category))
    live = {s: b for s, b in live.items() if b > 0}
    row = t.iloc[upto]
    print(f"{variant} rank {rank}: peak of {title} {int(total[upto]):,} B at row {upto} (step {row.step}, "
          f"{row.phase}); live storages >= 100 kB:")
    groups = {}
    for s, b in sorted(live.items(), key=lambda kv: -kv[1]):
        step, phase, cat = first[s]
        key = ("AIO-PINNED " if s in aio else "") + f"{cat} alloc'd {step}/{phase}"
        groups.setdefault(key, []).append(b)
    for key, sizes in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        big = [b for b in sizes if b >= 100_000]
        print(f"  {sum(sizes):>12,} B  {key}: {len(sizes)} storages; >=100kB: {big}")
