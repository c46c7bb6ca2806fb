//! brigade-tensor
