//! brigade-models
