//! Generates the service's code from `proto/` with protox, a protobuf compiler written in Rust:
//! building needs no `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/bank/v1/transfers.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure()
        // Map fields as `BTreeMap`, so that a message's fingerprint does not depend on the
        // order its entries came in.
        .btree_map(".")
        .compile_fds(descriptors)?;
    Ok(())
}
