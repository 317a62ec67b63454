//! With feature `host-kernels`, compiles `src/device/kernels.cu` for the
//! host (through `src/device/host_kernels.cpp`, a C++20 shim of CUDA's
//! built-ins) so tests can run the CUDA source itself on the CPU.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "host-kernels")]
    {
        println!("cargo:rerun-if-changed=src/device/kernels.cu");
        println!("cargo:rerun-if-changed=src/device/host_kernels.cpp");
        cc::Build::new()
            .cpp(true)
            .std("c++20")
            .file("src/device/host_kernels.cpp")
            .include("src/device")
            .opt_level(2)
            .warnings(false)
            .compile("memplan_host_kernels");
    }
}
