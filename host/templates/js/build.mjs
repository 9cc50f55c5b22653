// Builds plugin.js into a component of the idem `plugin` world: node build.mjs <out.wasm>
// (`idem build` runs it). No clocks, random, stdio or HTTP: a plugin is a pure function.
import { componentize } from "@bytecodealliance/componentize-js";
import { writeFile } from "node:fs/promises";
import { fileURLToPath } from "node:url";
import { dirname, resolve } from "node:path";

const here = dirname(fileURLToPath(import.meta.url));
const out = resolve(process.argv[2] ?? resolve(here, "{{name}}.wasm"));
const { component } = await componentize({
  sourcePath: resolve(here, "plugin.js"),
  witPath: resolve(here, "wit"),
  worldName: "plugin",
  disableFeatures: ["random", "stdio", "clocks", "http", "fetch-event"],
});
await writeFile(out, component);
console.log(`built ${out} (${component.byteLength} bytes)`);
