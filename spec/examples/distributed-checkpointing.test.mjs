// The guide's specimen (shared/GUIDE.txt, "Runnable artifact"), extended to the golden
// repositories of this directory: the guide's rule, "publish only when every expected shard was
// written with its checksum", applied in JavaScript to ckptfmt manifests of revisions 1.0, 1.1,
// 1.2 and 1.3 (FORMAT.md 5.7, 5.11, 5.14, 5.15), with no Python and no ckptfmt code. It shows the format is
// readable from its spec alone. Run: node --test spec/examples/distributed-checkpointing.test.mjs
import assert from "node:assert/strict";
import { readdirSync, readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import test from "node:test";
import { fileURLToPath } from "node:url";

// ---- the guide's own specimen, as printed there
const publish=({expected,written,checksums})=>written===expected&&checksums.every(Boolean);
test("manifest commits complete shards only",()=>{assert.equal(publish({expected:8,written:8,checksums:Array(8).fill(true)}),true);assert.equal(publish({expected:8,written:7,checksums:Array(7).fill(true)}),false);console.log("PASS: incomplete checkpoints stay private")});

// ---- the same rule over the golden manifests
const HERE = dirname(fileURLToPath(import.meta.url));
const REPOS = ["repo", "repo-1.1", "repo-1.2", "repo-packed"];
const prod = (xs) => xs.reduce((a, b) => a * b, 1);
const ceilDiv = (n, d) => (d === 0 ? 0 : Math.ceil(n / d));
const isCrc = (v) => Number.isInteger(v) && v >= 0 && v < 2 ** 32;

// The shard grid's offsets in C order (FORMAT.md 5.11 tiling; 5.14 derives them the same way).
function gridOffsets(shape, shardShape) {
  const counts = shape.map((n, d) => ceilDiv(n, shardShape[d]));
  const out = [];
  const total = prod(counts);
  for (let i = 0; i < total; i++) {
    let rest = i;
    const idx = new Array(counts.length);
    for (let d = counts.length - 1; d >= 0; d--) {
      idx[d] = rest % counts[d];
      rest = Math.floor(rest / counts[d]);
    }
    out.push(idx.map((k, d) => k * shardShape[d]));
  }
  return out;
}

// What the guide's publish() needs, for one tensor entry: the shards and stored inner chunks its
// geometry requires, how many the manifest lists, and whether each listed one has its checksum.
function tensorReceipt(entry) {
  const { shape, array, shards, chunks } = entry;
  const grid = gridOffsets(shape, array.shard_shape);
  const offsets = shards.offset ?? grid; // derived columns (1.2) leave the offsets out
  const chunkShape = array.chunk_shape;
  let expectedChunks = 0;
  for (const off of grid) {
    const clipped = shape.map((n, d) => Math.min(array.shard_shape[d], n - off[d]));
    expectedChunks += prod(clipped.map((c, d) => ceilDiv(c, chunkShape[d])));
  }
  const listed = shards.index_crc32c.length;
  const onGrid = offsets.length === listed && new Set(offsets.map(String)).size === listed &&
    offsets.every((o) => grid.some((g) => String(g) === String(o)));
  return {
    expected: grid.length + expectedChunks,
    written: (onGrid ? listed : -1) + chunks.crc32c.length,
    checksums: [...shards.index_crc32c, ...chunks.crc32c].map(isCrc),
  };
}

function publishable(manifest) {
  const tensors = Object.values(manifest.tensors);
  const state = Object.values(manifest.state ?? {});
  return tensors.every((t) => publish(tensorReceipt(t))) && state.every((s) => isCrc(s.crc32c));
}

function goldenManifests() {
  const out = [];
  for (const repo of REPOS) {
    const dir = join(HERE, repo, "manifests");
    for (const name of readdirSync(dir).sort()) {
      out.push({ where: `${repo}/manifests/${name}`, manifest: JSON.parse(readFileSync(join(dir, name), "utf8")) });
    }
  }
  return out;
}

test("every golden manifest lists every expected shard with its checksum", () => {
  const found = goldenManifests();
  assert.ok(found.length >= 4, `golden manifests found: ${found.length}`);
  for (const { where, manifest } of found) {
    assert.equal(manifest.format, "ckptfmt", where);
    assert.equal(publishable(manifest), true, where);
  }
});

test("a copy with one shard row removed is rejected (the broken control)", () => {
  for (const { where, manifest } of goldenManifests()) {
    const [key, entry] = Object.entries(manifest.tensors).find(([, e]) => e.shards.index_crc32c.length > 1)
      ?? Object.entries(manifest.tensors)[0];
    const copy = structuredClone(manifest);
    for (const column of Object.values(copy.tensors[key].shards)) column.pop();
    assert.equal(publishable(copy), false, `${where}: ${key} without its last shard row`);
    const unsummed = structuredClone(manifest);
    unsummed.tensors[key].shards.index_crc32c[0] = null;
    assert.equal(publishable(unsummed), false, `${where}: ${key} with a shard's checksum missing`);
    assert.equal(entry.shards.index_crc32c.length >= 1, true);
  }
});
