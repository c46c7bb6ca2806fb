//! brigade-ddp
