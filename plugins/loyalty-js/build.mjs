// Builds loyalty.js into a component of the `plugin` world: node build.mjs <out.wasm>
import { componentize } from "@bytecodealliance/componentize-js";
import { writeFile } from "node:fs/promises";
import { fileURLToPath } from "node:url";
import { dirname, resolve } from "node:path";

const here = dirname(fileURLToPath(import.meta.url));
const out = resolve(process.argv[2] ?? resolve(here, "../dist/loyalty-js.wasm"));
// componentize-js lets the source import only files under the working directory (or, when the
// source is outside it, under the source's own directory); the guest helper is in ../idem-js,
// so build from plugins/ wherever this script is started.
process.chdir(resolve(here, ".."));
const { component } = await componentize({
  sourcePath: resolve(here, "loyalty.js"),
  witPath: resolve(here, "../../wit"),
  worldName: "plugin",
  // No clocks, random, stdio or HTTP: a plugin is a pure function.
  disableFeatures: ["random", "stdio", "clocks", "http", "fetch-event"],
});
await writeFile(out, component);
console.log(`built ${out} (${component.byteLength} bytes)`);
