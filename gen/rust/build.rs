//! Compiles the repository's protos (../../protos) into the crate at build time: tonic-prost-build
//! writes the messages and the clients and servers, and this script writes the `wire_value` of
//! every constants enum value (constants.proto) as a `wire_value()` method, read from the
//! compiled descriptors so that no string of the contract is typed a second time.
//!
//! The compiler is protox (pure Rust), not protoc: a user of this crate then needs nothing but
//! cargo, while protoc is not on a typical Rust machine (this repository's only one is
//! grpcio-tools', a Python package), and a missing protoc would fail the build of every
//! dependent crate.

use std::error::Error;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use prost_reflect::{DescriptorPool, EnumDescriptor, Value};

/// The proto package of the contract, its files' directory and its `wire_value` option.
const PACKAGE: &str = "rollout_checkpoint.v1";
const WIRE_VALUE: &str = "rollout_checkpoint.v1.wire_value";

fn main() -> Result<(), Box<dyn Error>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let protos = root.join("protos");
    let googleapis = root.join("third_party/googleapis");
    let package_dir = protos.join(PACKAGE.replace('.', "/"));
    println!("cargo:rerun-if-changed={}", package_dir.display());

    let files = proto_files(&package_dir, &protos)?;
    let mut compiler = protox::Compiler::new([&protos, &googleapis])?;
    compiler.include_imports(true).open_files(&files)?;

    // google.rpc.Status comes from tonic-types, whose StatusExt decodes the ErrorInfo details.
    tonic_prost_build::configure()
        .extern_path(".google.rpc", "::tonic_types::pb")
        .compile_fds(compiler.file_descriptor_set())?;

    let out = PathBuf::from(std::env::var("OUT_DIR")?).join("wire_values.rs");
    std::fs::write(out, wire_values(&compiler.descriptor_pool())?)?;
    Ok(())
}

/// The .proto files of the contract's package, relative to the include root, sorted.
fn proto_files(dir: &Path, include_root: &Path) -> Result<Vec<PathBuf>, Box<dyn Error>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|ext| ext == "proto") {
            files.push(path.strip_prefix(include_root)?.to_path_buf());
        }
    }
    files.sort();
    Ok(files)
}

/// Rust source: for each enum of the package with `wire_value` options, a `wire_value()`
/// method matching on the value's number (a value without the option, UNSPECIFIED, is "").
fn wire_values(pool: &DescriptorPool) -> Result<String, Box<dyn Error>> {
    let option = pool
        .get_extension_by_name(WIRE_VALUE)
        .ok_or_else(|| format!("{WIRE_VALUE} is not in the compiled protos"))?;
    let mut source = format!(
        "/// The proto package this crate speaks.\npub const API_PACKAGE: &str = {PACKAGE:?};\n"
    );
    for enumeration in pool.all_enums().filter(|e| e.package_name() == PACKAGE) {
        let arms = wire_value_arms(&enumeration, &option);
        if arms.is_empty() {
            continue;
        }
        writeln!(
            source,
            "impl {name} {{\n    /// The exact string this value stands for on the wire (its `wire_value` option).\n    \
             pub fn wire_value(self) -> &'static str {{\n        match self as i32 {{\n{arms}            _ => \"\",\n        }}\n    }}\n}}",
            name = enumeration.name(),
        )?;
    }
    Ok(source)
}

fn wire_value_arms(
    enumeration: &EnumDescriptor,
    option: &prost_reflect::ExtensionDescriptor,
) -> String {
    let mut arms = String::new();
    for value in enumeration.values() {
        let options = value.options();
        if !options.has_extension(option) {
            continue;
        }
        if let Value::String(text) = options.get_extension(option).as_ref() {
            arms.push_str(&format!("            {} => {text:?},\n", value.number()));
        }
    }
    arms
}
