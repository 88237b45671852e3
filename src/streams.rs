//! `ax streams apply|print`: the one way to change an existing stream or consumer.

use crate::conn::Conn;
use crate::server::TopologyArgs;
use anyhow::Result;
use clap::Subcommand;

#[derive(Subcommand)]
pub(crate) enum StreamsCommand {
    /// Create or update every stream, bucket and queue consumer; refuse incompatible changes.
    Apply(TopologyArgs),
    /// Print the stream definitions as applied (JSON, one per line).
    Print(TopologyArgs),
}

pub(crate) async fn run(command: StreamsCommand, conn: &Conn) -> Result<()> {
    match command {
        StreamsCommand::Apply(args) => {
            let js = async_nats::jetstream::new(conn.connect().await?);
            for applied in ax_server::streams::apply(&js, &args.topology()?, &args.queues).await? {
                let outcome = format!("{:?}", applied.outcome).to_lowercase();
                println!("{outcome:<10} {}", applied.object);
                for d in &applied.differences {
                    println!("           {}: {} -> {}", d.field, d.existing, d.desired);
                }
            }
        }
        StreamsCommand::Print(args) => {
            for config in ax_server::streams::stream_configs(&args.topology()?)? {
                println!("{}", serde_json::to_string(&config)?);
            }
        }
    }
    Ok(())
}
