//! Compiles tollgate's own proto into Rust, and builds the descriptor set that server reflection
//! serves: tollgate's Admission service plus the vendored closure of Envoy's `external_auth.proto`
//! and `external_processor.proto`.
//! Envoy's Rust types come from `envoy-types`; its protos are compiled here only for reflection.
//! protox does the parsing, so no system `protoc` is needed.

use std::{env, fs, path::PathBuf};

use prost::Message as _;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let out = PathBuf::from(env::var("OUT_DIR")?);

    let own = protox::compile(["tollgate/v1/admission.proto"], ["proto"])?;
    tonic_prost_build::configure().build_client(true).build_server(true).compile_fds(own.clone())?;

    let mut reflection = protox::compile(
        ["envoy/service/auth/v3/external_auth.proto", "envoy/service/ext_proc/v3/external_processor.proto"],
        ["proto/vendor"],
    )?;
    for file in own.file {
        if !reflection.file.iter().any(|f| f.name == file.name) {
            reflection.file.push(file);
        }
    }
    fs::write(out.join("reflection_descriptor.bin"), reflection.encode_to_vec())?;
    Ok(())
}
