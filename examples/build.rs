//! Generates the gRPC service's code from `proto/` with protox, a protobuf compiler in Rust:
//! building the example needs no `protoc` on the machine.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/idem/example/v1/payments.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure()
        // Map fields as `BTreeMap`: a message re-encodes with its entries in one order, so that
        // its idempotency fingerprint does not depend on the order a client sent them in.
        .btree_map(".")
        .compile_fds(descriptors)?;
    Ok(())
}
