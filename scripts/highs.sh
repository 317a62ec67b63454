#!/usr/bin/env bash
# A prebuilt HiGHS for the tests' build, in target/highs: the library and
# headers of PyPI's `highsbox` wheel (HiGHS 1.15.1, one patch above the
# 1.15.0 that highs-sys bundles), pinned by its hash, with a pkg-config
# file naming them. highs-sys's `discover` feature (Cargo.toml) links it
# instead of compiling the bundled C++ sources (442 s of wall time and
# 711 s of CPU alone on the 2-core machine: docs/testing.md).
#
# Prints nothing and exits 0 when target/highs is ready; prints why and
# exits 1 when it cannot be (another platform than Linux x86_64, no
# network to PyPI): scripts/test.sh then builds HiGHS from source, as a
# plain `cargo build` does. Called from the repository root.
set -euo pipefail
dir=target/highs
version=1.15.1
wheel=highsbox-$version-py3-none-manylinux2014_x86_64.whl
sha256=17f30d23ef37488467732b45f141146f7c287826a576b4514ae39a8cc4068b28
# The pkg-config file names absolute paths: written on every call, so a
# moved checkout finds its own library.
write_pc() {
  local abs
  abs=$(cd "$dir" && pwd)
  cat > "$dir/highs.pc" <<EOF
libdir=$abs/lib
includedir=$abs/include/highs

Name: HiGHS
Description: HiGHS $version, prebuilt (PyPI's highsbox wheel)
Version: $version
Libs: -L\${libdir} -lhighs
Cflags: -I\${includedir}
EOF
}
if [ -f "$dir/lib/libhighs.so" ] && [ -f "$dir/include/highs/interfaces/highs_c_api.h" ]; then
  write_pc
  exit 0
fi
if [ "$(uname -s)-$(uname -m)" != Linux-x86_64 ]; then
  echo "highs.sh: no prebuilt HiGHS for $(uname -s)-$(uname -m)" >&2
  exit 1
fi
# pip from the project's .venv (made here when missing, as
# scripts/python_tests.sh would make it).
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
rm -rf "$dir" && mkdir -p "$dir/download"
if ! .venv/bin/python -m pip download --quiet --no-deps --only-binary=:all: \
    --platform manylinux2014_x86_64 --require-hashes -d "$dir/download" \
    -r /dev/stdin <<< "highsbox==$version --hash=sha256:$sha256" >&2; then
  echo "highs.sh: could not download $wheel from PyPI" >&2
  rm -rf "$dir"
  exit 1
fi
.venv/bin/python - "$dir" "$dir/download/$wheel" <<'EOF'
import pathlib, shutil, sys, zipfile

out, wheel = pathlib.Path(sys.argv[1]), sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    lib = next(n for n in z.namelist() if n.endswith("/highs_dist/lib/libhighs.so"))
    root = lib[: -len("lib/libhighs.so")]
    for name in z.namelist():
        rel = name[len(root):] if name.startswith(root) else None
        if rel and (rel == "lib/libhighs.so" or (rel.startswith("include/") and not rel.startswith("include/openblas/"))):
            target = out / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(name) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
shutil.rmtree(out / "download")
EOF
write_pc
