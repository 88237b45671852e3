//! `ax event …`: publish an event that flows wait for (docs/PROTOCOL.md §6, "Events").

use crate::conn::Conn;
use anyhow::Result;
use ax_sdk::Client;
use clap::Subcommand;

#[derive(Subcommand)]
pub(crate) enum EventCommand {
    /// Publish event NAME (`ax.events.NAME`, kept in AX_EVENTS): the flows' waits for it
    /// whose match it meets end with it as their output. Prints its sequence.
    Publish {
        /// Event name: 1..=8 dot-separated tokens of A-Z a-z 0-9 _ - (`order.paid`).
        name: String,
        /// The payload: JSON text, `@FILE` (a file holding JSON) or `-` (JSON on standard
        /// input).
        #[arg(default_value = "{}")]
        payload: String,
        /// An id: a publish retried within two minutes with the same id is one event.
        #[arg(long)]
        id: Option<String>,
    },
}

pub(crate) async fn run(command: EventCommand, conn: &Conn) -> Result<()> {
    let client = Client::new(conn.connect().await?);
    match command {
        EventCommand::Publish { name, payload, id } => {
            let payload = crate::flow::json_arg(&payload)?;
            let seq = client.publish_event(&name, &payload, id.as_deref()).await?;
            println!("published event {name} (AX_EVENTS sequence {seq})");
        }
    }
    Ok(())
}
