//! `kernels.cu` compiled with NVRTC for the device in hand.
//!
//! The module loaded is machine code (a cubin) for the device's own
//! architecture (`sm_XY`), not PTX. The driver compiles PTX only if it is
//! at least as new as the NVRTC that wrote it, and an NVRTC newer than the
//! driver is the usual case with pip's CUDA wheels (PyTorch's bring one);
//! machine code loads on any driver of the same CUDA major version (CUDA's
//! minor-version compatibility). Only when this NVRTC cannot write machine
//! code for the architecture (a GPU newer than it knows) is PTX
//! (`compute_XY`) loaded instead, for the driver to compile.
//!
//! The compiler's resource report (`--ptxas-options=-v`: registers, spills,
//! shared memory per kernel) comes back with the image; a test checks it
//! against each kernel's launch bound.
//!
//! Machine code is cached on disk, so only a process's first compile for
//! a given source, architecture and NVRTC pays NVRTC's few seconds: in
//! `$MEMPLAN_CACHE_DIR`, else `$XDG_CACHE_HOME/memplan`, else
//! `~/.cache/memplan` (`MEMPLAN_CACHE_DIR=` with no value turns it off).
//! The file name holds a hash of all three, so a changed kernel or
//! compiler is compiled afresh. The cache is only an optimisation: a
//! directory that cannot be read or written is passed over.

use std::ffi::{CStr, CString, c_char};
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};

use cudarc::nvrtc::{Ptx, result, sys};

use crate::device::KERNELS_CU;
use crate::error::{Result, RuntimeError};

/// A compiled `kernels.cu`.
pub struct Compiled {
    /// What `cuModuleLoadData` takes.
    pub image: Ptx,
    /// True for machine code, false for PTX.
    pub machine_code: bool,
    /// NVRTC's log: ptxas's resource report for machine code.
    pub log: String,
}

/// Compiles `kernels.cu` for compute capability `major.minor`, or reads
/// the machine code from the cache (see the module docs).
pub fn compile_kernels(major: i32, minor: i32) -> Result<Compiled> {
    compile_kernels_in(cache_dir().as_deref(), major, minor)
}

/// The cache directory the environment names, if any.
fn cache_dir() -> Option<PathBuf> {
    let var = |name| std::env::var_os(name);
    match var("MEMPLAN_CACHE_DIR") {
        Some(d) if d.is_empty() => None,
        Some(d) => Some(PathBuf::from(d)),
        None => var("XDG_CACHE_HOME")
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
            .or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .map(|d| d.join("memplan")),
    }
}

/// The cache file of the machine code of `source` for `sm_XY` by NVRTC
/// `nvrtc` (its major and minor version).
fn cache_name(source: &str, major: i32, minor: i32, nvrtc: (i32, i32)) -> String {
    let mut h = std::hash::DefaultHasher::new();
    (source, major, minor, nvrtc).hash(&mut h);
    format!("kernels-sm_{major}{minor}-{:016x}.cubin", h.finish())
}

/// Writes `bytes` to `path` through a temporary file, so a concurrent
/// reader sees the whole file or none.
fn store(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

fn nvrtc_version() -> (i32, i32) {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: writes two ints.
    let _ = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    (major, minor)
}

/// [`compile_kernels`] with the cache in `cache` (None: no cache).
pub fn compile_kernels_in(cache: Option<&Path>, major: i32, minor: i32) -> Result<Compiled> {
    let path = cache.map(|d| d.join(cache_name(KERNELS_CU, major, minor, nvrtc_version())));
    if let Some(bytes) = path.as_ref().and_then(|p| std::fs::read(p).ok()) {
        if !bytes.is_empty() {
            return Ok(Compiled {
                image: Ptx::from_binary(bytes),
                machine_code: true,
                log: format!("(machine code read from {})", path.unwrap().display()),
            });
        }
    }
    let sm = format!("--gpu-architecture=sm_{major}{minor}");
    match compile(&[sm.as_str(), "--ptxas-options=-v"], Output::Cubin) {
        Ok((image, log)) => {
            if let (Some(p), Image::Cubin(bytes)) = (&path, &image) {
                let _ = store(p, bytes);
            }
            Ok(Compiled {
                image: image.into_ptx(),
                machine_code: true,
                log,
            })
        }
        Err(cubin_error) => {
            let ptx = format!("--gpu-architecture=compute_{major}{minor}");
            compile(&[ptx.as_str()], Output::Ptx)
                .map(|(image, log)| Compiled {
                    image: image.into_ptx(),
                    machine_code: false,
                    log,
                })
                .map_err(|ptx_error| RuntimeError::Device {
                    library: "NVRTC",
                    call: "nvrtcCompileProgram(kernels.cu)".into(),
                    why: format!("for sm_{major}{minor}: {cubin_error}; as PTX: {ptx_error}"),
                })
        }
    }
}

#[derive(Clone, Copy)]
enum Output {
    Cubin,
    Ptx,
}

/// What NVRTC wrote.
enum Image {
    Cubin(Vec<u8>),
    Ptx(String),
}

impl Image {
    fn into_ptx(self) -> Ptx {
        match self {
            Image::Cubin(bytes) => Ptx::from_binary(bytes),
            Image::Ptx(text) => Ptx::from_src(text),
        }
    }
}

/// One NVRTC compilation; the error is NVRTC's code and log.
fn compile(options: &[&str], output: Output) -> std::result::Result<(Image, String), String> {
    let src = CString::new(KERNELS_CU).expect("kernels.cu has no NUL");
    let name = CString::new("memplan_kernels.cu").expect("no NUL");
    let prog = result::create_program(&src, Some(&name)).map_err(|e| format!("{e:?}"))?;
    // SAFETY: `prog` is a live program until destroyed below; every pointer
    // handed to NVRTC outlives the call.
    let out = unsafe {
        let compiled = result::compile_program(prog, options);
        let log = result::get_program_log(prog)
            .map(|l| {
                CStr::from_ptr(l.as_ptr())
                    .to_string_lossy()
                    .trim()
                    .to_string()
            })
            .unwrap_or_default();
        match compiled {
            Err(e) => Err(format!("{e:?}: {log}")),
            Ok(()) => image(prog, output).map(|image| (image, log)),
        }
    };
    // SAFETY: created above and not used after this.
    let _ = unsafe { result::destroy_program(prog) };
    out
}

/// The compiled program's cubin or PTX.
///
/// # Safety
/// `prog` must be a compiled, live NVRTC program.
unsafe fn image(prog: sys::nvrtcProgram, output: Output) -> std::result::Result<Image, String> {
    match output {
        Output::Ptx => {
            let ptx =
                unsafe { result::get_ptx(prog) }.map_err(|e| format!("nvrtcGetPTX: {e:?}"))?;
            let text = unsafe { CStr::from_ptr(ptx.as_ptr()) };
            Ok(Image::Ptx(text.to_string_lossy().into_owned()))
        }
        Output::Cubin => {
            let mut size = 0usize;
            unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }
                .result()
                .map_err(|e| format!("nvrtcGetCUBINSize: {e:?}"))?;
            let mut data = vec![0u8; size];
            unsafe { sys::nvrtcGetCUBIN(prog, data.as_mut_ptr() as *mut c_char) }
                .result()
                .map_err(|e| format!("nvrtcGetCUBIN: {e:?}"))?;
            if size == 0 {
                return Err("NVRTC wrote an empty cubin".into());
            }
            Ok(Image::Cubin(data))
        }
    }
}

/// One kernel's resources in ptxas's report.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Resources {
    pub kernel: String,
    pub registers: u32,
    pub spill_bytes: u64,
    pub shared_bytes: u64,
}

/// Each kernel's registers, spills and static shared memory from a
/// `--ptxas-options=-v` log.
pub fn resources(log: &str) -> Vec<Resources> {
    let number_before = |line: &str, unit: &str| -> u64 {
        line.split(',')
            .find_map(|part| {
                part.trim()
                    .strip_suffix(unit)?
                    .split_whitespace()
                    .last()?
                    .parse()
                    .ok()
            })
            .unwrap_or(0)
    };
    let mut out: Vec<Resources> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let kernel = rest.split('\'').next().unwrap_or_default().to_string();
            out.push(Resources {
                kernel,
                ..Resources::default()
            });
        } else if let Some(r) = out.last_mut() {
            if line.contains("spill stores") {
                r.spill_bytes = number_before(line, "bytes spill stores")
                    + number_before(line, "bytes spill loads");
            } else if line.contains("Used ") {
                let used = line.split("Used ").nth(1).unwrap_or_default();
                r.registers = used
                    .split_whitespace()
                    .next()
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0);
                r.shared_bytes = number_before(line, "bytes smem");
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::DevKernel;

    #[test]
    fn cache_files_name_source_architecture_and_compiler() {
        let name = cache_name("src", 9, 0, (13, 0));
        assert!(name.starts_with("kernels-sm_90-") && name.ends_with(".cubin"));
        assert_eq!(name, cache_name("src", 9, 0, (13, 0)));
        for other in [
            cache_name("src2", 9, 0, (13, 0)),
            cache_name("src", 8, 0, (13, 0)),
            cache_name("src", 9, 0, (12, 8)),
        ] {
            assert_ne!(name, other);
        }
        // Written whole, through a temporary file.
        let dir = std::env::temp_dir().join(format!("memplan-cache-unit-{}", std::process::id()));
        let path = dir.join("a").join(&name);
        store(&path, b"cubin").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"cubin");
        assert_eq!(
            std::fs::read_dir(path.parent().unwrap()).unwrap().count(),
            1
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn reads_ptxas_resource_reports() {
        let log = "ptxas info    : 145 bytes gmem\n\
            ptxas info    : Compiling entry function 'flash_attn_fwd' for 'sm_90'\n\
            ptxas info    : Function properties for flash_attn_fwd\n\
            ptxas         .     0 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n\
            ptxas info    : Used 136 registers, used 1 barriers, 33024 bytes smem\n\
            ptxas info    : Compiling entry function 'cast' for 'sm_90'\n\
            ptxas info    : Function properties for cast\n\
            ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
            ptxas info    : Used 28 registers, used 0 barriers\n";
        let r = resources(log);
        assert_eq!(
            r,
            vec![
                Resources {
                    kernel: "flash_attn_fwd".into(),
                    registers: 136,
                    spill_bytes: 20,
                    shared_bytes: 33024
                },
                Resources {
                    kernel: "cast".into(),
                    registers: 28,
                    spill_bytes: 0,
                    shared_bytes: 0
                },
            ]
        );
    }

    /// NVRTC needs no GPU: scripts/test.sh runs this with the NVRTC of
    /// PyTorch's CUDA wheels on LD_LIBRARY_PATH (`--ignored`), so CI
    /// compiles the kernels with the real compiler, not only a host shim.
    #[test]
    #[ignore = "needs libnvrtc.so on LD_LIBRARY_PATH (scripts/test.sh provides it)"]
    fn kernels_compile_to_machine_code_within_their_launch_bounds() {
        // SAFETY: only tries to open the library.
        assert!(
            unsafe { sys::is_culib_present() },
            "NVRTC could not be loaded: put libnvrtc.so's directory on LD_LIBRARY_PATH"
        );
        // A cache of its own, so every architecture compiles here first.
        let cache = std::env::temp_dir().join(format!("memplan-nvrtc-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&cache);
        // Ampere, Hopper and Blackwell data-centre GPUs.
        for (major, minor) in [(8, 0), (9, 0), (10, 0)] {
            let c = compile_kernels_in(Some(&cache), major, minor)
                .unwrap_or_else(|e| panic!("sm_{major}{minor}: {e}"));
            assert!(c.machine_code, "sm_{major}{minor}: fell back to PTX");
            // The second time, from the cache.
            let again = compile_kernels_in(Some(&cache), major, minor).unwrap();
            assert!(
                again.machine_code && again.log.contains("read from"),
                "{}",
                again.log
            );
            let report = resources(&c.log);
            for k in DevKernel::ALL {
                let r = report
                    .iter()
                    .find(|r| r.kernel == k.name())
                    .unwrap_or_else(|| {
                        panic!("sm_{major}{minor}: no report for {}:\n{}", k.name(), c.log)
                    });
                let bound = k.launch_bound();
                // A block's registers come from one multiprocessor's 64 Ki.
                assert!(
                    r.registers as u64 * bound as u64 <= 65536,
                    "sm_{major}{minor}: {r:?} cannot run {bound} threads per block"
                );
                assert_eq!(r.spill_bytes, 0, "sm_{major}{minor}: {r:?} spills");
                assert!(
                    r.shared_bytes <= 48 * 1024,
                    "sm_{major}{minor}: {r:?} static shared memory"
                );
            }
            assert_eq!(report.len(), DevKernel::ALL.len(), "{:?}", report);
        }
        let cached = std::fs::read_dir(&cache).unwrap().count();
        std::fs::remove_dir_all(&cache).unwrap();
        assert_eq!(cached, 3, "one cubin per architecture");
        // The PTX fallback: every kernel is an unmangled entry.
        let Ok((Image::Ptx(text), _)) = compile(&["--gpu-architecture=compute_90"], Output::Ptx)
        else {
            panic!("no PTX for compute_90");
        };
        for k in DevKernel::ALL {
            assert!(
                text.contains(&format!(".entry {}(", k.name())),
                "no .entry {} in the PTX",
                k.name()
            );
        }
        // The tensor-core kernels use the instruction, not the trap that
        // stands in for it below sm_80.
        assert!(
            text.contains("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"),
            "no bf16 mma.sync in the PTX"
        );
    }
}
