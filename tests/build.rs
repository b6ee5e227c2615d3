//! Generates the gRPC test service's code from `proto/` with protox (no `protoc` needed).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/idem/test/v1/jobs.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure()
        .btree_map(".")
        .compile_fds(descriptors)?;
    Ok(())
}
