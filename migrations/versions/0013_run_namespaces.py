"""run namespaces: a token's team, and run names unique per owner

``api_tokens.team`` (nullable): tokens of one team share their runs (write the same run, join it by
name). ``runs.owner_key`` says whose namespace a run's name lives in: ``team:<team>`` for a token
with a team, ``token:<id>`` for one without, ``''`` for runs registered with auth disabled or before
migration 0005 (no owner). Run names become unique per owner key instead of globally, so a name
registered first by someone else cannot capture another owner's job: each owner gets its own run.

Revision ID: 0013
Revises: 0012
"""
from alembic import op
import sqlalchemy as sa

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('api_tokens', sa.Column('team', sa.Text(), nullable=True))
    op.add_column('runs', sa.Column('owner_key', sa.Text(), nullable=False, server_default=''))
    op.execute("UPDATE runs SET owner_key = 'token:' || owner_token_id WHERE owner_token_id IS NOT NULL")
    op.drop_constraint(op.f('uq_runs_name'), 'runs', type_='unique')
    op.create_unique_constraint(op.f('uq_runs_owner_key_name'), 'runs', ['owner_key', 'name'])
    op.create_index(op.f('ix_runs_name'), 'runs', ['name'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_runs_name'), table_name='runs')
    op.drop_constraint(op.f('uq_runs_owner_key_name'), 'runs', type_='unique')
    op.create_unique_constraint(op.f('uq_runs_name'), 'runs', ['name'])
    op.drop_column('runs', 'owner_key')
    op.drop_column('api_tokens', 'team')
