pub mod hjson;
pub mod value;
